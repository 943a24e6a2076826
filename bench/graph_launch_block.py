"""Does replaying a CUDA graph wait on the host while the same graph is still running? (GPU only)

torch.profiler showed ~455 us of host time per ``cudaGraphLaunch`` in workload (a)'s decode steps
(bench/RESULTS.md, session 45), where a launch is normally tens of us, and the device idles ~50 us
before each decode graph's first kernel. If a replay of a graph blocks the host until the previous
replay of the same executable graph is done, a step's host work after the replay (LM head, sampler,
the token copy) starts late, and two captures of the same decode, replayed alternately, would avoid
it. This times the host side of ``CUDAGraph.replay`` for one graph of ``--kernels`` small kernels
plus ``--matmuls`` GEMMs (about a decode step's GPU time), issued while a replay of the same graph runs, vs
while the other capture's runs (each trial from an idle device). Prints the median host us of that call.
(A first version timed back-to-back replays: every call then waits ~a replay's GPU time for the launch
queue, whichever graph, 2026-12-04 session 46: it could not tell the two apart.)

    python bench/graph_launch_block.py --json out.json   # ~20 s
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402


def capture(work) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()  # warm-up outside the graph (allocator, cuBLAS handles)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        work()
    torch.cuda.synchronize()
    return graph


def host_us_of_second_replay(first: torch.cuda.CUDAGraph, second: torch.cuda.CUDAGraph,
                             trials: int) -> tuple[float, float]:
    """(median host us of ``second.replay()`` issued while ``first``'s replay runs, GPU ms of the pair).
    Each trial starts from an idle device, so the launch queue is empty: back-to-back replays would
    measure the queue filling up (every call then waits ~a replay's GPU time, whichever graph), not a
    wait on the same executable graph."""
    host, pair = [], []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first.replay()
        t = time.perf_counter()
        second.replay()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        pair.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e6, statistics.median(pair) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=300, help="small elementwise kernels in the graph")
    ap.add_argument("--matmuls", type=int, default=20, help="4096^2 bf16 GEMMs in the graph (~0.15 ms each)")
    ap.add_argument("--replays", type=int, default=100, help="trials, each from an idle device")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    small = torch.zeros(4096, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def work():
        for i in range(args.kernels):
            small.add_(1.0)
            if args.matmuls and i % max(1, args.kernels // args.matmuls) == 0:
                torch.matmul(a, a, out=out)

    one, two = capture(work), capture(work)
    rows = {}
    for name, (first, second) in (("same graph", (one, one)), ("the other capture", (one, two)),
                                  ("same graph again", (one, one))):
        host_us, pair_ms = host_us_of_second_replay(first, second, args.replays)
        rows[name] = dict(host_us_second_replay=round(host_us, 1), ms_per_pair=round(pair_ms, 3))
        print(f"{name:20s} host {host_us:8.1f} us for the replay issued while one runs; {pair_ms:.3f} ms the pair",
              flush=True)
    result = dict(provenance(" ".join(sys.argv)), kernels=args.kernels, matmuls=args.matmuls, replays=args.replays,
                  rows=rows)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
