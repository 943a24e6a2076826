"""OpenAIBackend: generate through any OpenAI-compatible server (``rollout.backend=openai``).

Prompts go as token ids to ``POST /v1/completions`` with ``logprobs`` and
``return_token_ids``, so the trainer gets back exactly the sampled ids (never a re-tokenized
text) with their log-probs. Servers:

* ``asyncrl serve`` — returns ``token_ids`` and ``token_versions`` per choice, and takes new
  weights at ``POST /v1/update_weights`` (a safetensors body): ``weight_sync: http``.
* vLLM (>= 0.10.2) returns ``token_ids`` when asked with ``return_token_ids``. Its
  weight-update routes (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config``) are
  ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update`` around an NCCL or CUDA-IPC transfer, plus ``/pause`` and
  ``/resume``; SGLang's are ``/update_weights_from_disk`` (a checkpoint path),
  ``/init_weights_update_group`` + ``/update_weights_from_distributed`` (NCCL), and
  ``/pause_generation`` / ``/continue_generation``. asyncrl does not drive those transfers yet:
  use ``weight_sync: none`` and sync them yourself. ``weight_sync: disk`` writes the weights to
  a directory the server shares and posts the path (asyncrl serve's JSON form).

Per-token versions come from the server when it sends them, else the version last pushed.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any, Iterable, Optional

import torch

from asyncrl.types import Completion, RequestOutput, SamplingParams


def request_body(model: str, prompt_ids: list[int], params: SamplingParams, session_id: Optional[str] = None) -> dict:
    """``completions.create`` keyword arguments for one token-id prompt."""
    extra: dict[str, Any] = {"return_token_ids": True, "top_k": params.top_k, "ignore_eos": params.ignore_eos}
    if session_id:
        extra["session_id"] = session_id
    body = {"model": model, "prompt": list(prompt_ids), "n": params.n, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1, "extra_body": extra}
    if session_id:  # also as a header: a router need not parse the body to keep a session on one replica
        body["extra_headers"] = {"X-Session-Id": session_id}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def completion_from_choice(choice, version: int) -> Completion:
    """One ``Completion`` from an OpenAI completion choice carrying ``token_ids``."""
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        raise RuntimeError("the server returned no token ids: it must support 'return_token_ids' "
                           "(asyncrl serve, vLLM >= 0.10.2)")
    logprobs = list(choice.logprobs.token_logprobs) if choice.logprobs is not None else [0.0] * len(ids)
    versions = getattr(choice, "token_versions", None) or [version] * len(ids)
    return Completion(token_ids=list(ids), text=choice.text, logprobs=[float(x) for x in logprobs],
                      finish_reason=choice.finish_reason or "stop", versions=list(versions))


class OpenAIBackend:
    """Invariant: ``version`` is the version of the weights last pushed to (and acknowledged
    by) the server; tokens are tagged with the server's versions when it reports them."""

    inflight_weight_update = False  # a push waits for the running generate call (one HTTP round)

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, weight_sync: str = "http",
                 timeout_s: float = 600.0, max_connections: int = 256, shared_dir: Optional[str] = None,
                 version: int = 0, http_client: str = "auto"):
        """``http_client``: ``auto`` (aiohttp when installed, else httpx), ``aiohttp`` or ``httpx``."""
        if weight_sync not in ("http", "disk", "none"):
            raise ValueError(f"weight_sync must be http, disk or none, got {weight_sync!r}")
        if http_client not in ("auto", "aiohttp", "httpx"):
            raise ValueError(f"http_client must be auto, aiohttp or httpx, got {http_client!r}")
        self.http_client = http_client
        self.base_url, self.model = base_url.rstrip("/"), model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.weight_sync, self.timeout_s, self.max_connections = weight_sync, timeout_s, max_connections
        self.shared_dir, self.version = shared_dir, version

    def async_client(self):
        """An ``openai.AsyncOpenAI`` for one generate call, over aiohttp when it is installed.

        Why aiohttp: httpx's shared connection pool is itself the bottleneck at hundreds of
        concurrent requests (encode/httpx#3215; measured in bench/RESULTS.md, "asyncrl serve"); the
        SDK's ``DefaultAioHttpClient`` (the ``openai[aiohttp]`` extra) keeps its API on aiohttp,
        the client vLLM's serving benchmark uses. ``http_client="httpx"`` forces the old one."""
        import openai

        http = None
        aiohttp_client = getattr(openai, "DefaultAioHttpClient", None)  # openai >= 1.95
        if self.http_client != "httpx" and aiohttp_client is not None:
            # the SDK's own Limits class (httpx or httpx2, by SDK version): its client takes only that
            limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=self.max_connections,
                                                            max_keepalive_connections=self.max_connections)
            try:
                http = aiohttp_client(limits=limits, timeout=self.timeout_s)
            except RuntimeError:  # the SDK without its aiohttp extra
                if self.http_client == "aiohttp":
                    raise
        if http is None:
            if self.http_client == "aiohttp":
                raise RuntimeError("http_client='aiohttp' needs openai >= 1.95 with its aiohttp extra "
                                   "(pip install 'openai[aiohttp]')")
            import httpx
            http = httpx.AsyncClient(limits=httpx.Limits(max_connections=self.max_connections,
                                                         max_keepalive_connections=self.max_connections),
                                     timeout=self.timeout_s)
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=2,
                                  timeout=self.timeout_s, http_client=http)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        return asyncio.run(self._generate(prompt_token_ids, params))

    async def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        async with self.async_client() as client:
            outs = await asyncio.gather(*(client.completions.create(**request_body(self.model, ids, params))
                                          for ids in prompts))
        return [RequestOutput(list(ids), None, [completion_from_choice(c, self.version)
                                                for c in sorted(out.choices, key=lambda c: c.index)])
                for ids, out in zip(prompts, outs)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push HF-named tensors: as one safetensors body (``http``), as a file in
        ``shared_dir`` whose path is posted (``disk``), or not at all (``none``)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"}
        if self.weight_sync == "none":
            self.version = version
            return
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        if self.weight_sync == "http":
            from safetensors.torch import save
            response = httpx.post(f"{self.base_url}/v1/update_weights", content=save(tensors), timeout=self.timeout_s,
                                  headers={**headers, "Content-Type": "application/octet-stream",
                                           "X-Policy-Version": str(version)})
        else:
            response = self._post_file(tensors, version, headers)
        if response.status_code != 200:
            raise RuntimeError(f"weight update to {self.base_url} failed ({response.status_code}): "
                               f"{response.text[:500]}")
        self.version = version

    def _post_file(self, tensors: dict, version: int, headers: dict):
        import httpx
        from safetensors.torch import save_file

        directory = self.shared_dir or tempfile.gettempdir()
        path = os.path.join(directory, f"asyncrl-weights-v{version}.safetensors")
        save_file(tensors, path)
        try:
            return httpx.post(f"{self.base_url}/v1/update_weights", json={"path": path, "version": version},
                              headers=headers, timeout=self.timeout_s)
        finally:
            os.remove(path)


def served_model_name(base_url: str, api_key: Optional[str]) -> str:
    """The first model the server lists (``GET /v1/models``)."""
    import httpx

    key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise RuntimeError(f"rollout.openai.base_url={base_url}: no model listed at /v1/models ({err})") from None


def build_openai_backend(cfg) -> OpenAIBackend:
    """From ``rollout.openai`` (an ``OpenAIServerConfig``)."""
    model = cfg.model or served_model_name(cfg.base_url, cfg.api_key)
    return OpenAIBackend(cfg.base_url, model, cfg.api_key, cfg.weight_sync, cfg.timeout_s, cfg.max_connections,
                         cfg.shared_dir)
