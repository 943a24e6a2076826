"""The HTTP client's own cost in ``rollout.backend=openai``: aiohttp vs httpx, one run.

    python bench/openai_client_overhead.py [--requests 256] [--tokens 256] [--repeats 5]

A canned OpenAI-compatible server (its own process, Starlette + uvicorn on 127.0.0.1) answers
every ``/v1/completions`` at once with a fixed choice of ``--tokens`` token ids and log-probs, so
the time of one ``OpenAIBackend.generate`` of ``--requests`` concurrent prompts is the client and
the loopback, not a model. Each repeat runs both clients, alternating which goes first; the
report is the median seconds per call for each and their ratio. Why it matters: an RL step sends
all its prompts at once (256 at issue 4's workload a), and httpx's shared pool serialises them
(encode/httpx#3215); on one H200 the same ``asyncrl serve`` delivered 0.33 of ``LLM.generate``'s
tokens/s to an httpx client and 0.83 to an aiohttp one (bench/RESULTS.md, "asyncrl serve").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SERVER = r'''
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

tokens = int(sys.argv[2])
choice = {"index": 0, "text": "x" * tokens, "finish_reason": "length", "token_ids": list(range(tokens)),
          "logprobs": {"tokens": ["x"] * tokens, "token_logprobs": [-0.5] * tokens, "top_logprobs": None,
                       "text_offset": list(range(tokens))}}

async def completions(request):
    body = await request.json()
    choices = [dict(choice, index=i) for i in range(body.get("n", 1))]
    import json
    return Response(json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                                "choices": choices}), media_type="application/json")

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", backlog=4096)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the canned server did not listen on {port} within {timeout_s:.0f}s")


def one_call(client: str, port: int, prompts: list[list[int]]) -> float:
    """Seconds for one generate of all prompts with ``client``; checks every answer arrived."""
    from asyncrl.rollout.openai_backend import OpenAIBackend
    from asyncrl.types import SamplingParams

    backend = OpenAIBackend(f"http://127.0.0.1:{port}", "canned", "k", weight_sync="none",
                            max_connections=len(prompts), http_client=client)
    start = time.perf_counter()
    outs = backend.generate(prompts, SamplingParams(n=1, max_tokens=8, temperature=1.0))
    seconds = time.perf_counter() - start
    assert len(outs) == len(prompts) and all(len(o.completions[0].token_ids) > 0 for o in outs)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="token ids per canned answer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.tokens)], env=dict(os.environ))
    try:
        wait_listening(port)
        prompts = [[1 + (i % 50)] * 16 for i in range(args.requests)]
        one_call("httpx", port, prompts[:8])  # warm: imports, the server's first requests
        one_call("aiohttp", port, prompts[:8])
        times: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
        for repeat in range(args.repeats):
            order = ("httpx", "aiohttp") if repeat % 2 == 0 else ("aiohttp", "httpx")
            for client in order:
                times[client].append(one_call(client, port, prompts))
    finally:
        server.terminate()
        server.wait(10)
    median = {c: statistics.median(t) for c, t in times.items()}
    result = {"requests": args.requests, "tokens": args.tokens, "repeats": args.repeats,
              "seconds": times, "median_s": median, "httpx_over_aiohttp": median["httpx"] / median["aiohttp"],
              "load_average": os.getloadavg()[0]}
    print(f"{args.requests} concurrent requests, {args.tokens} tokens each: httpx {median['httpx']:.3f} s, "
          f"aiohttp {median['aiohttp']:.3f} s per call (median of {args.repeats}); httpx/aiohttp "
          f"{result['httpx_over_aiohttp']:.2f}x; load average {result['load_average']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
