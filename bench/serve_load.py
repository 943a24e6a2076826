"""Load test of ``asyncrl serve`` on loopback: C concurrent clients for D seconds (bounded).

    python bench/serve_load.py [--clients 64] [--seconds 60] [--max-tokens 16]

Starts ``asyncrl serve`` as its own process on 127.0.0.1 with a tiny random Qwen3 (hidden 64,
2 layers, character tokenizer) on CPU, then runs C asyncio clients, each sending
``/v1/completions`` requests back to back (a 12-character prompt, ``max_tokens`` tokens with
``ignore_eos``, temperature 1) until D seconds have passed. Reports requests/s, generated
tokens/s, latency p50/p99, errors (any non-200 or exception), and the server's resident memory
(VmRSS) sampled every second: its median over the first and the last 10 s of the run (flat
memory: no growth with the number of requests served). Only 127.0.0.1 is contacted, and the
request loop stops by itself after D seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def build_checkpoint(directory: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.serve.chat_fixtures import chat_tokenizer, save_checkpoint, tiny_model

    tok = chat_tokenizer("qwen3", directory)
    return save_checkpoint(tiny_model(tok, seed=0, max_len=512), tok, directory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client_loop(url: str, deadline: float, max_tokens: int, latencies: list, errors: list, seed: int):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.perf_counter() < deadline:
            prompt = "".join(rng.choice("abcdefghij0123456789 ") for _ in range(12))
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                    "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                r = await http.post("/v1/completions", json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
            except Exception as err:  # noqa: BLE001 - counted, reported
                ok, r = False, err
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors.append(str(getattr(r, "status_code", r))[:200])


async def sample_memory(pid: int, deadline: float, samples: list):
    while time.perf_counter() < deadline:
        samples.append((time.perf_counter(), rss_mib(pid)))
        await asyncio.sleep(1.0)


async def run(url: str, pid: int, clients: int, seconds: float, max_tokens: int) -> dict:
    latencies, errors, memory = [], [], []
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(sample_memory(pid, deadline, memory),
                         *(client_loop(url, deadline, max_tokens, latencies, errors, i) for i in range(clients)))
    wall = time.perf_counter() - start
    lat = sorted(latencies)
    first = [m for t, m in memory if t - start <= 10]
    last = [m for t, m in memory if t - start >= seconds - 10]
    return {"clients": clients, "seconds": round(wall, 1), "requests": len(lat), "errors": len(errors),
            "error_samples": errors[:5], "requests_per_s": round(len(lat) / wall, 1),
            "tokens_per_s": round(len(lat) * max_tokens / wall, 1),
            "latency_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
            "latency_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "rss_first10s_mib": round(statistics.median(first), 1) if first else None,
            "rss_last10s_mib": round(statistics.median(last), 1) if last else None,
            "rss_max_mib": round(max(m for _, m in memory), 1) if memory else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_load.jsonl"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "tiny")
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", str(checkpoint), "--host", "127.0.0.1",
                                   "--port", str(port), "--device", "cpu", "--served-model-name", "tiny",
                                   "--max-concurrent", str(4 * args.clients)], env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            result = asyncio.run(run(url, server.pid, args.clients, args.seconds, args.max_tokens))
        finally:
            server.terminate()
            server.wait(timeout=30)
    result.update({"max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d %H:%M"),
                   "load_average": os.getloadavg()[0], "cpus": os.cpu_count()})
    print(json.dumps(result, indent=2))
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
