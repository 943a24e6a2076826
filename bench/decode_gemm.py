"""Decode-step GEMMs at small M: cuBLAS (what the engine runs) vs Inductor's autotuned Triton templates.

A decode step of the 0.6B shape at batch 128 spends ~25 us per layer in its four GEMMs (qkv, o,
gate_up, down: 31 MB of bf16 weights, ~1.2 TB/s; bench/RESULTS.md, issue 20). This times each
linear of the decoder at M rows (the batch) inside CUDA graphs, as the engine replays them
(``triton.testing.do_bench_cudagraph``): ``F.linear`` (cuBLAS) against the same call compiled with
``mode="max-autotune-no-cudagraphs"`` (Inductor benchmarks its Triton GEMM templates and cuBLAS
and keeps the fastest), and prints us, weight bandwidth and the ratio. A ratio well above 1 says a
Triton GEMM would pay in the engine at that M.

    python bench/decode_gemm.py --json OUT.json            # ~1-2 min on one H200
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

# (name, in_features, out_features) of Qwen3-0.6B's decoder linears (q/k/v and gate/up merged as
# the engine merges them)
SHAPES = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]


def time_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=50) * 1000.0


def one(m: int, k: int, n: int, dtype) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    eager = time_us(lambda: F.linear(x, w))
    tuned_fn = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
    tuned_fn(x, w)
    torch.cuda.synchronize()
    tuned = time_us(lambda: tuned_fn(x, w))
    err = (tuned_fn(x, w).float() - F.linear(x, w).float()).abs().max().item()
    gb = n * k * x.element_size() / 1e9
    return dict(m=m, k=k, n=n, cublas_us=round(eager, 2), autotuned_us=round(tuned, 2),
                cublas_tb_s=round(gb / eager * 1e3, 2), autotuned_tb_s=round(gb / tuned * 1e3, 2),
                speedup=round(eager / tuned, 3), max_abs_diff=err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="8,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch._inductor.config.max_autotune_gemm_backends = "TRITON,ATEN"
    rows = []
    for m in map(int, args.ms.split(",")):
        for name, k, n in SHAPES:
            row = dict(name=name, **one(m, k, n, torch.bfloat16))
            rows.append(row)
            print(json.dumps(row), flush=True)
    per_m = {}
    for r in rows:
        d = per_m.setdefault(r["m"], [0.0, 0.0])
        d[0] += r["cublas_us"]
        d[1] += min(r["cublas_us"], r["autotuned_us"])
    for m, (c, best) in per_m.items():
        print(f"M={m}: four GEMMs per layer cuBLAS {c:.1f} us, best of both {best:.1f} us "
              f"(x28 layers: {(c - best) * 28 / 1000:.3f} ms per decode step to gain)")
    write_json(args.json, dict(provenance(" ".join(sys.argv)), rows=rows))


if __name__ == "__main__":
    main()
