"""``asyncrl serve MODEL_OR_RUN_DIR [--host H] [--port P] ...``: load the model, run uvicorn.

The model is an HF checkpoint directory (config.json + safetensors + tokenizer) or an asyncrl
run directory (its latest checkpoint). The engine runs Qwen3 / Qwen2 / Llama / Mistral
checkpoints (``asyncrl.engine.models``); the tokenizer's chat template and tool-call format
come with the checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import threading
from pathlib import Path
from typing import Optional

from asyncrl.data.tool_calls import build_tool_parser
from asyncrl.serve.async_engine import AsyncEngine
from asyncrl.serve.limits import ServeLimits


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl serve", description="OpenAI-compatible server on the asyncrl engine")
    p.add_argument("model", help="HF checkpoint directory, or an asyncrl run directory (its latest checkpoint)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: the "
                                                             "directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                                                   "(default: $ASYNCRL_API_KEY, else none)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--tool-parser", default="auto", help="auto (from the chat template) | hermes | llama3_json | none")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--max-concurrent", type=int, default=256, help="generation requests in flight (beyond: 429)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (beyond: 413)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def build_state(model_path: str, served_name: Optional[str] = None, api_key: Optional[str] = None,
                limits: Optional[ServeLimits] = None, tool_parser: str = "auto", dtype=None,
                device: Optional[str] = None, **engine_kwargs):
    """A started ``AsyncEngine`` over the checkpoint and the server state around it."""
    from asyncrl.engine import LLM
    from asyncrl.eval.job import resolve_model_path
    from asyncrl.serve.app import ServerState

    path = resolve_model_path(model_path)
    llm = LLM(str(path), dtype=dtype, device=device, **engine_kwargs)
    if llm.tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer files: the server needs one to read prompts")
    engine = AsyncEngine(llm).start()
    name = served_name or Path(model_path).resolve().name
    return ServerState(engine, llm.tokenizer, name, limits or ServeLimits(),
                       build_tool_parser(tool_parser, llm.tokenizer), api_key)


def main(argv: list[str]) -> int:
    import os

    import torch
    import uvicorn

    from asyncrl.serve.app import build_app

    args = parse_args(argv)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    limits = ServeLimits(max_tokens=args.max_tokens, max_concurrent=args.max_concurrent,
                         max_body_bytes=args.max_body_bytes)
    engine_kwargs = {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.max_model_len:
        engine_kwargs["max_model_len"] = args.max_model_len
    state = build_state(args.model, args.served_model_name, args.api_key or os.environ.get("ASYNCRL_API_KEY"),
                        limits, args.tool_parser, dtype, args.device, **engine_kwargs)
    print(f"asyncrl serve: '{state.model_name}' on http://{args.host}:{args.port}/v1 "
          f"(tool calls: {getattr(state.tool_parser, 'name', 'off')})", flush=True)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.engine.close()
    return 0


class BackgroundServer:
    """uvicorn in a thread on a free loopback port (tests, benchmarks, in-process trainers).

        with BackgroundServer(state) as url:   # "http://127.0.0.1:PORT"
            OpenAI(base_url=url + "/v1", api_key=...)
    """

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        from asyncrl.serve.app import build_app

        self.state = state
        config = uvicorn.Config(build_app(state), host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="asyncrl-serve", daemon=True)

    def __enter__(self) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        with contextlib.suppress(Exception):
            self.state.engine.close()
