"""The OpenAI-compatible HTTP server over one engine: ``asyncrl serve MODEL_OR_RUN_DIR``.

FastAPI (pydantic validation, OpenAPI docs) on uvicorn, the stack vLLM and SGLang serve with,
so OpenAI clients, load balancers and the fleet router see the behaviour they expect:

    GET  /health                  {"status": "ok", "version": v, "running": n, "engine": {steps,
                                  prefill_steps, decode_steps, decode_rows, ...}} (LLM.metrics:
                                  counters since start; decode_rows / decode_steps = mean batch)
    GET  /v1/models               the served model
    POST /v1/completions          text or token-id prompts; stream, logprobs, n, stop, seed
    POST /v1/chat/completions     the model's chat template and tool-call format
    POST /v1/update_weights       new policy weights: JSON {"path", "version"} (a checkpoint dir
                                  or .safetensors file on this host) or a safetensors body with
                                  header X-Policy-Version (remote trainers)

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with
the status OpenAI uses: 400 bad request (malformed JSON included), 401 bad API key, 404
unknown model or route, 413 body over the limit, 429 over ``max_concurrent``; the server
keeps serving after any of them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.data.chat_render import render_ids
from asyncrl.data.templates import TemplateError
from asyncrl.serve import responses as R
from asyncrl.serve.async_engine import AsyncEngine, SampleDelta
from asyncrl.serve.auth import ApiKey
from asyncrl.serve.limits import BodyLimit, ServeLimits
from asyncrl.serve.protocol import SESSION_HEADER, ChatCompletionRequest, CompletionRequest, UpdateWeightsRequest
from asyncrl.serve.streaming import ChatStreamer, TextStreamer, sse
from asyncrl.types import RequestOutput, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ServerState:
    """What every handler needs. Invariant: ``in_flight`` counts generation requests admitted
    and not yet answered (streams until their last chunk), never more than ``max_concurrent``."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    limits: ServeLimits
    tool_parser: Any = None
    api_key: Optional[str] = None
    in_flight: int = 0


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="asyncrl", docs_url=None, redoc_url=None)
    app.state.serve = state
    app.add_middleware(BodyLimit, max_bytes=state.limits.max_body_bytes,
                       per_path={"/v1/update_weights": state.limits.max_weight_bytes})
    if state.api_key:  # added last: the outermost layer, so a bad key is refused before the body is read
        app.add_middleware(ApiKey, key=state.api_key)
    _install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": state.engine.version, "running": state.in_flight,
                "engine": state.engine.llm.metrics}  # int counters: read without the engine's lock

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "asyncrl", "max_model_len": state.engine.llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [_encode_prompt(state, p) for p in _prompts(body)]
        params = [_sampling(state, body, len(ids), body.max_tokens) for ids in prompts]
        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "stream=true takes one prompt per request", param="prompt")
            return _stream_response(state, _stream_completion(state, body, prompts[0], params[0], request))
        async with _admitted(state):
            outputs = await asyncio.gather(*(state.engine.generate(ids, sp, _request_id(request, body, i))
                                             for i, (ids, sp) in enumerate(zip(prompts, params))))
        choices = [R.completion_choice(p * body.n + i, c, state.tokenizer,
                                       body.logprobs is not None, body.return_token_ids)
                   for p, out in enumerate(outputs) for i, c in enumerate(out.completions)]
        return R.response_body("text_completion", R.new_id("cmpl"), body.model, choices,
                               sum(len(ids) for ids in prompts), _completion_tokens(outputs),
                               _prompt_ids_field(body, prompts))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        tools = body.active_tools
        if tools and state.tool_parser is None:
            raise APIError(400, "tools were given but the model's chat template has no tool-call format "
                                "(start the server with --tool-parser hermes|llama3_json)", param="tools")
        try:
            ids = render_ids(state.tokenizer, body.messages, tools, body.add_generation_prompt,
                             body.chat_template_kwargs)
        except TemplateError as err:
            raise APIError(400, str(err), param="messages") from None
        params = _sampling(state, body, len(ids), body.completion_budget)
        if body.stream:
            return _stream_response(state, _stream_chat(state, body, ids, params, bool(tools), request))
        async with _admitted(state):
            out = await state.engine.generate(ids, params, _request_id(request, body, 0))
        choices = [R.chat_choice(i, c, state.tokenizer, state.tool_parser, bool(tools), body.logprobs,
                                 body.return_token_ids) for i, c in enumerate(out.completions)]
        return R.response_body("chat.completion", R.new_id("chatcmpl"), body.model, choices, len(ids),
                               _completion_tokens([out]), ids if body.return_token_ids else None)

    @app.post("/v1/update_weights")
    async def update_weights(request: Request):
        version, kv, tensors = await _weights_from_request(request)
        try:
            await state.engine.update_weights(tensors, version, kv=kv)
        except (KeyError, ValueError) as err:
            raise APIError(400, f"weights do not fit the served model: {err}") from None
        return {"status": "ok", "version": state.engine.version}

    return app


# ---- request helpers ------------------------------------------------------------------

def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{state.model_name}')",
                       param="model", code="model_not_found")


def _prompts(body: CompletionRequest) -> list:
    try:
        return body.prompts()
    except ValueError as err:
        raise APIError(400, str(err), param="prompt") from None


def _encode_prompt(state: ServerState, prompt) -> list[int]:
    """Text through the tokenizer (with BOS, as the trainer's PromptEncoder); ids as given."""
    if isinstance(prompt, str):
        ids = list(state.tokenizer(prompt)["input_ids"])
    else:
        ids = list(prompt)
        vocab = state.engine.llm.model.config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    return ids


def _sampling(state: ServerState, body, prompt_len: int, max_tokens: Optional[int]) -> SamplingParams:
    limits, max_len = state.limits, state.engine.llm.max_model_len
    room = max_len - prompt_len
    if room <= 0:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt has "
                            f"{prompt_len}", param="messages" if hasattr(body, "messages") else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, room)
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of {limits.max_tokens}",
                       param="max_tokens")
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; you requested "
                            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
                       param="max_tokens", code="context_length_exceeded")
    if not state.engine.llm.fits(prompt_len + max_tokens):
        raise APIError(400, f"{prompt_len + max_tokens} tokens do not fit this server's KV cache",
                       param="max_tokens", code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    # the engine computes the sampled tokens' log-probs anyway: always kept (token_versions too)
    return SamplingParams(n=body.n, temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                          top_k=body.top_k, max_tokens=max_tokens, seed=body.seed, stop=body.stops,
                          ignore_eos=body.ignore_eos, logprobs=True)


def _request_id(request: Request, body, index: int) -> str:
    session = body.session_id or request.headers.get(SESSION_HEADER)
    base = R.new_id("req")
    return f"{session}/{base}-{index}" if session else f"{base}-{index}"


def _completion_tokens(outputs: list[RequestOutput]) -> int:
    return sum(len(c.token_ids) for out in outputs for c in out.completions)


def _prompt_ids_field(body: CompletionRequest, prompts: list[list[int]]):
    if not body.return_token_ids:
        return None
    return prompts[0] if len(prompts) == 1 else prompts


def _admit(state: ServerState) -> None:
    """Count a generation request in ``in_flight``; 429 when the server is full."""
    if state.in_flight >= state.limits.max_concurrent:
        raise APIError(429, f"server busy: {state.limits.max_concurrent} requests in flight (--max-concurrent); "
                            "retry later", type_="rate_limit_error")
    state.in_flight += 1


class _admitted:
    """``_admit`` for the duration of a non-streamed request."""

    def __init__(self, state: ServerState):
        self.state = state

    async def __aenter__(self):
        _admit(self.state)

    async def __aexit__(self, *exc):
        self.state.in_flight -= 1


async def _weights_from_request(request: Request):
    """(version, kv, named tensors) from a JSON path request or a safetensors body."""
    from safetensors.torch import load as load_bytes

    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            spec = UpdateWeightsRequest.model_validate_json(await request.body())
        except ValueError as err:
            raise APIError(400, f"bad update_weights request: {err}") from None
        return spec.version, spec.kv, _tensors_from_path(spec.path)
    version = request.headers.get("x-policy-version")
    if version is None or not version.isdigit():
        raise APIError(400, "a safetensors body needs the header X-Policy-Version: <int>")
    kv = request.headers.get("x-kv", "keep")
    if kv not in ("keep", "recompute"):
        raise APIError(400, "X-KV must be 'keep' or 'recompute'")
    try:
        tensors = load_bytes(await request.body())
    except Exception as err:  # safetensors raises its own SafetensorError
        raise APIError(400, f"body is not a safetensors blob: {err}") from None
    return int(version), kv, list(tensors.items())


def _tensors_from_path(path: str):
    import os

    from safetensors.torch import load_file

    from asyncrl.engine.models.loader import iter_safetensors

    if os.path.isdir(path):
        try:
            return list(iter_safetensors(path))
        except FileNotFoundError as err:
            raise APIError(400, str(err), param="path") from None
    if os.path.isfile(path):
        return list(load_file(path).items())
    raise APIError(400, f"no checkpoint at {path!r} on the server's host", param="path")


# ---- streaming -----------------------------------------------------------------------------

def _stream_response(state: ServerState, chunks: AsyncIterator[str]) -> StreamingResponse:
    _admit(state)  # refused before the 200 status is sent

    async def body():
        try:
            async for chunk in _guarded(chunks):
                yield chunk
        finally:
            state.in_flight -= 1
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream_completion(state: ServerState, body: CompletionRequest, ids: list[int], params: SamplingParams,
                             request: Request):
    streamer = TextStreamer(state.tokenizer, params.n, params.stop)
    head = {"id": R.new_id("cmpl"), "object": "text_completion", "model": body.model}
    async for event in _events(state, ids, params, body, request):
        if isinstance(event, SampleDelta):
            text = streamer.feed(event.index, event.token_ids)
            choice = {"index": event.index, "text": text, "finish_reason": None,
                      "logprobs": R.completion_logprobs(state.tokenizer, event.token_ids, event.logprobs)
                      if body.logprobs is not None else None}
            yield sse(_chunk(head, choice, body, event, ids))
        else:
            for i, c in enumerate(event.completions):
                choice = {"index": i, "text": streamer.finish(i, c.text), "logprobs": None,
                          "finish_reason": R.FINISH_REASONS.get(c.finish_reason, c.finish_reason)}
                yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": R.usage(len(ids), _completion_tokens([event]))})
    yield "data: [DONE]\n\n"


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, ids: list[int], params: SamplingParams,
                       tools_active: bool, request: Request):
    streamer = ChatStreamer(state.tokenizer, params.n, params.stop, state.tool_parser if tools_active else None)
    head = {"id": R.new_id("chatcmpl"), "object": "chat.completion.chunk", "model": body.model}
    for i in range(params.n):
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None, "logprobs": None}]})
    async for event in _events(state, ids, params, body, request):
        if isinstance(event, SampleDelta):
            text = streamer.feed(event.index, event.token_ids)
            choice = {"index": event.index, "delta": {"content": text} if text else {}, "finish_reason": None,
                      "logprobs": R.chat_logprobs(state.tokenizer, event.token_ids, event.logprobs)
                      if body.logprobs else None}
            yield sse(_chunk(head, choice, body, event, ids))
        else:
            for i, c in enumerate(event.completions):
                delta, called = streamer.finish_chat(i, c.text)
                finish = "tool_calls" if called and c.finish_reason == "stop" else R.FINISH_REASONS.get(
                    c.finish_reason, c.finish_reason)
                yield sse({**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                                "logprobs": None}]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": R.usage(len(ids), _completion_tokens([event]))})
    yield "data: [DONE]\n\n"


def _chunk(head: dict, choice: dict, body, event: SampleDelta, ids: list[int]) -> dict:
    if body.return_token_ids:
        choice.update(R.extension_fields(event.token_ids, event.versions))
    chunk = {**head, "choices": [choice]}
    if body.return_token_ids:
        chunk["prompt_token_ids"] = ids
    return chunk


async def _events(state: ServerState, ids: list[int], params: SamplingParams, body, request: Request):
    """The engine's deltas, then its final output."""
    async for event in state.engine.stream(ids, params, _request_id(request, body, 0)):
        yield event


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The 200 status is sent with the first chunk: a later failure ends the stream with an
    OpenAI error event (what the ``openai`` client raises as ``APIError``), then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except (ValueError, RuntimeError) as err:
        yield sse(error_body(str(err), "server_error"))
        yield "data: [DONE]\n\n"


# ---- errors --------------------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, err: APIError):
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, err: RequestValidationError):
        problems = err.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return JSONResponse(error_body("request body is not valid JSON", "invalid_request_error"),
                                status_code=400)
        first = problems[0] if problems else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):
        return JSONResponse(error_body(str(err.detail), "invalid_request_error"), status_code=err.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_request, err: ValueError):  # the engine refused the request (KV pool)
        return JSONResponse(error_body(str(err), "invalid_request_error"), status_code=400)

