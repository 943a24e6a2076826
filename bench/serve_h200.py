"""Tokens/s through ``asyncrl serve`` (HTTP) against ``LLM.generate`` at the same concurrency.

    python bench/serve_h200.py [--concurrency 256] [--prompt 256] [--response 256] [--clients aiohttp,httpx]
    python bench/serve_h200.py --shape tiny --prompt 64 --response 64 --repeats 3   # CPU: the same A/B, tiny model

On one GPU: a Qwen3-0.6B-shaped model with random bf16 weights (transformers' config, no
download) and a word-level tokenizer over its 151,936 ids is saved to a temporary directory.
1. ``LLM.generate`` of C random token-id prompts (P tokens each, R generated, EOS ignored,
   temperature 1) in one call -> generated tokens / wall seconds.
2. The same checkpoint behind ``asyncrl serve`` (its own process, 127.0.0.1): C concurrent
   ``/v1/completions`` requests (token-id prompts, n=1, the same P/R) -> generated tokens / wall
   seconds from the first request sent to the last response read, once per client library:
   ``aiohttp`` (what vLLM's serving benchmark drives servers with) and ``httpx`` with one shared
   ``AsyncClient`` (the client of the first H200 row; its connection pool costs O(concurrency)
   per request event, encode/httpx#3215, so at C=256 it measures mostly itself).
Each side is warmed up first (CUDA graphs, allocator, compiled sampler). For both sides the
engine's own counters (``LLM.metrics``; the server's ``/health``) give the steps the timed part
took: prefill steps, decode steps and the mean decode batch, so a server that admitted its
requests as many small prefills, or decoded in batches that never fill, shows it. Per client:
``first_response_s`` / ``last_response_s`` (seconds from the first request sent). Prints and
appends one JSON line to bench/results/serve_h200.jsonl; the issue's bar is http/llm >= 0.8.
``--repeats N``: N timed runs per side, the median reported; on a CPU the in-process engine and the
server are alive together and alternate run by run (a shared machine's load hits both alike).
About 2-3 minutes on one H200; needs ``aiohttp`` (``pip install asyncrl[bench]``).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


CUDA = torch.cuda.is_available()
DTYPE = "bfloat16" if CUDA else "float32"  # a CPU run (--shape tiny) only checks the script


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def save_checkpoint(directory: Path, max_pos: int, shape: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from asyncrl.engine.bench import SHAPES, build_random_hf

    model = build_random_hf(shape, getattr(torch, DTYPE), "cpu", max_pos)
    model.save_pretrained(str(directory), safe_serialization=True)
    vocab = {f"t{i}": i for i in range(SHAPES[shape]["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t1").save_pretrained(
        str(directory))
    return directory


VOCAB = {"qwen3-0.6b": 151936, "tiny": 512}


def prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(count)]


def step_counts(before: dict, after: dict) -> dict:
    """The engine steps between two ``LLM.metrics`` snapshots (the timed part)."""
    d = {k: after[k] - before[k] for k in ("steps", "prefill_steps", "decode_steps", "decode_rows")}
    return {"steps": d["steps"], "prefill_steps": d["prefill_steps"], "decode_steps": d["decode_steps"],
            "mean_decode_batch": round(d["decode_rows"] / max(d["decode_steps"], 1), 1)}


class EngineSide:
    """``LLM.generate`` in this process: C prompts in one call, warmed up at full size."""

    def __init__(self, path: Path, args):
        from asyncrl.engine import LLM
        from asyncrl.types import SamplingParams

        self.args = args
        self.llm = LLM(str(path), dtype=getattr(torch, DTYPE), max_model_len=args.prompt + args.response + 16)
        self.params = SamplingParams(n=1, temperature=1.0, max_tokens=args.response, ignore_eos=True,
                                     logprobs=True, seed=0)
        self.llm.generate(prompts(args.concurrency, args.prompt, 1, VOCAB[args.shape]), self.params)  # warm-up
        _sync()

    def run(self, seed: int) -> dict:
        """One timed ``generate`` of fresh prompts (no prefix-cache hits)."""
        before = dict(self.llm.metrics)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts(self.args.concurrency, self.args.prompt, seed, VOCAB[self.args.shape]),
                                 self.params)
        _sync()
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
        return {"tokens_per_s": round(tokens / wall), "wall_s": round(wall, 3), **step_counts(before, self.llm.metrics)}

    def close(self) -> None:
        self.llm.close()
        del self.llm
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s, plus every run's tokens/s (a shared CPU is noisy)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def _body(ids: list[int], max_tokens: int) -> dict:
    return {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


async def _burst_aiohttp(url: str, batch: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=len(batch))
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(ids):
            async with http.post("/v1/completions", json=_body(ids, max_tokens)) as r:
                r.raise_for_status()
                usage = (await r.json())["usage"]
            return time.perf_counter(), usage["completion_tokens"]
        return await asyncio.gather(*(one(ids) for ids in batch))


async def _burst_httpx(url: str, batch: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
    limits = httpx.Limits(max_connections=len(batch), max_keepalive_connections=len(batch))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def one(ids):
            r = await http.post("/v1/completions", json=_body(ids, max_tokens))
            r.raise_for_status()
            return time.perf_counter(), r.json()["usage"]["completion_tokens"]
        return await asyncio.gather(*(one(ids) for ids in batch))


BURSTS = {"aiohttp": _burst_aiohttp, "httpx": _burst_httpx}


def timed_burst(url: str, client: str, batch: list[list[int]], max_tokens: int) -> dict:
    """One burst of C concurrent requests, timed, with the engine steps it took (``/health``)."""
    before = httpx.get(url + "/health", timeout=10).json()["engine"]
    t0 = time.perf_counter()
    done = asyncio.run(BURSTS[client](url, batch, max_tokens))
    wall = time.perf_counter() - t0
    counts = step_counts(before, httpx.get(url + "/health", timeout=10).json()["engine"])
    tokens = sum(n for _, n in done)
    return {"tokens_per_s": round(tokens / wall), "wall_s": round(wall, 3),
            "first_response_s": round(min(t for t, _ in done) - t0, 3),
            "last_response_s": round(max(t for t, _ in done) - t0, 3), **counts}


class ServerSide:
    """``asyncrl serve`` on the same checkpoint in its own process (127.0.0.1), warmed up with
    one burst; ``with ServerSide(path, args) as server: server.run(client, seed)``."""

    def __init__(self, path: Path, args):
        self.path, self.args = path, args

    def __enter__(self) -> "ServerSide":
        args = self.args
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # keep carried wheels' paths
            filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        if not CUDA:
            env["OMP_NUM_THREADS"] = "1"  # as the in-process side (torch.set_num_threads(1) in main)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "serve", str(self.path), "--port", str(port), "--dtype", DTYPE,
             "--served-model-name", "m", "--max-concurrent", "4096", "--max-tokens", str(args.response),
             "--max-model-len", str(args.prompt + args.response + 16), "--max-body-bytes", str(16 << 20)], env=env)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy()
            client = args.clients.split(",")[0]
            asyncio.run(BURSTS[client](self.url, prompts(args.concurrency, args.prompt, 1, VOCAB[args.shape]),
                                       args.response))  # warm-up
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        for _ in range(1200):
            if self.server.poll() is not None:
                raise RuntimeError(f"asyncrl serve exited with {self.server.returncode} before it was healthy")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError("asyncrl serve was not healthy after 300 s")

    def run(self, client: str, seed: int) -> dict:
        batch = prompts(self.args.concurrency, self.args.prompt, seed, VOCAB[self.args.shape])
        return timed_burst(self.url, client, batch, self.args.response)

    def __exit__(self, *exc) -> None:
        self.server.terminate()
        self.server.wait(timeout=60)


def measure(path: Path, args) -> tuple[dict, dict]:
    """(LLM.generate run, {client: HTTP run}), medians of ``args.repeats``. Each timed run gets
    fresh prompts. On a GPU the two engines run one after the other (each takes most of its
    memory); on a CPU they are alive together and alternate run by run, so the load of a
    shared machine hits both sides alike."""
    clients = args.clients.split(",")
    seeds = iter(range(2, 10_000))
    llm_runs, http_runs = [], {c: [] for c in clients}
    if CUDA:
        engine = EngineSide(path, args)
        llm_runs = [engine.run(next(seeds)) for _ in range(args.repeats)]
        engine.close()
        with ServerSide(path, args) as server:
            for _ in range(args.repeats):
                for client in clients:
                    http_runs[client].append(server.run(client, next(seeds)))
    else:
        engine = EngineSide(path, args)
        with ServerSide(path, args) as server:
            for _ in range(args.repeats):
                llm_runs.append(engine.run(next(seeds)))
                for client in clients:
                    http_runs[client].append(server.run(client, next(seeds)))
        engine.close()
    return median_run(llm_runs), {c: median_run(r) for c, r in http_runs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(VOCAB))
    p.add_argument("--clients", default="aiohttp,httpx", help="client libraries, in order (the first warms up)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side; the median is reported")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_h200.jsonl"))
    args = p.parse_args()
    if unknown := set(args.clients.split(",")) - set(BURSTS):
        p.error(f"unknown client(s) {sorted(unknown)}; choose from {sorted(BURSTS)}")
    if "aiohttp" in args.clients.split(",") and importlib.util.find_spec("aiohttp") is None:  # before the minutes
        p.error("--clients aiohttp needs aiohttp (pip install 'asyncrl[bench]'), or pass --clients httpx")
    if not CUDA:
        torch.set_num_threads(1)  # the server process gets OMP_NUM_THREADS=1: the same compute per side
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(Path(tmp), args.prompt + args.response + 16, args.shape)
        llm, http = measure(path, args)
    row = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu", "shape": args.shape,
           "concurrency": args.concurrency, "prompt": args.prompt, "response": args.response,
           "llm_generate": llm, "http": http,
           "http_over_llm": {c: round(r["tokens_per_s"] / llm["tokens_per_s"], 3) for c, r in http.items()},
           "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(row, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
