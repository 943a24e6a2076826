"""Tokens/s through ``asyncrl serve`` (HTTP) against ``LLM.generate`` at the same concurrency.

    python bench/serve_h200.py [--concurrency 256] [--prompt 256] [--response 256]

On one GPU: a Qwen3-0.6B-shaped model with random bf16 weights (transformers' config, no
download) and a word-level tokenizer over its 151,936 ids is saved to a temporary directory.
1. ``LLM.generate`` of C random token-id prompts (P tokens each, R generated, EOS ignored,
   temperature 1) in one call -> generated tokens / wall seconds.
2. The same checkpoint behind ``asyncrl serve`` (its own process, 127.0.0.1): C concurrent
   ``/v1/completions`` requests (token-id prompts, n=1, the same P/R) -> generated tokens / wall
   seconds from the first request sent to the last response read.
Each side is warmed up first (CUDA graphs, allocator). Prints and appends one JSON line to
bench/results/serve_h200.jsonl; the issue's bar is http/llm >= 0.8. About 2-3 minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
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


def bench_llm(path: Path, args) -> float:
    from asyncrl.engine import LLM
    from asyncrl.types import SamplingParams

    llm = LLM(str(path), dtype=getattr(torch, DTYPE), max_model_len=args.prompt + args.response + 16)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.response, ignore_eos=True, logprobs=True, seed=0)
    llm.generate(prompts(args.concurrency, args.prompt, 1, VOCAB[args.shape]), params)  # warm-up at full size
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts(args.concurrency, args.prompt, 2, VOCAB[args.shape]), params)
    _sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    llm.close()
    del llm
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return tokens / wall


async def _burst(url: str, batch: list[list[int]], max_tokens: int) -> int:
    limits = httpx.Limits(max_connections=len(batch), max_keepalive_connections=len(batch))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def one(ids):
            r = await http.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": max_tokens,
                                                         "temperature": 1.0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        return sum(await asyncio.gather(*(one(ids) for ids in batch)))


def bench_http(path: Path, args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", str(path), "--port", str(port),
                               "--dtype", DTYPE, "--served-model-name", "m", "--max-concurrent", "4096",
                               "--max-tokens", str(args.response), "--max-model-len",
                               str(args.prompt + args.response + 16), "--max-body-bytes", str(16 << 20)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(  # keep carried wheels' paths
                                  filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if server.poll() is not None:
                raise RuntimeError(f"asyncrl serve exited with {server.returncode} before it was healthy")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise TimeoutError("asyncrl serve was not healthy after 300 s")
        asyncio.run(_burst(url, prompts(args.concurrency, args.prompt, 1, VOCAB[args.shape]), args.response))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(_burst(url, prompts(args.concurrency, args.prompt, 2, VOCAB[args.shape]), args.response))
        return tokens / (time.perf_counter() - t0)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(VOCAB))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_h200.jsonl"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(Path(tmp), args.prompt + args.response + 16, args.shape)
        llm_tps = bench_llm(path, args)
        http_tps = bench_http(path, args)
    row = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu", "shape": args.shape,
           "concurrency": args.concurrency, "prompt": args.prompt, "response": args.response, "llm_generate_tokens_per_s": round(llm_tps), "http_tokens_per_s": round(http_tps),
           "http_over_llm": round(http_tps / llm_tps, 3), "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(row, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
