"""Decode GEMMs under torch's BLAS switches: do the cuBLAS / cuBLASLt choice or the reduced-precision
reduction change what a 0.6B decode step's four linears cost at 256 rows?

The engine's decode GEMMs (``F.linear`` of bf16 activations ``[M, K]`` and weights ``[N, K]``) are
latency-bound at M = 128-256: ~5-7 us each for 4-12.6 MB of weights (bench/decode_gemm.py; Inductor's
Triton templates and a Triton split-K measured no faster). torch picks among cuBLAS backends and
algorithms by switches the engine leaves at their defaults; this times each of Qwen3-0.6B's four
decoder linears per switch in CUDA graphs (``triton.testing.do_bench_cudagraph``), the switches
interleaved, and prints one layer's sum (x 28 = a decode step's GEMM time):

  default                  torch's defaults
  cublas                   ``torch.backends.cuda.preferred_blas_library("cublas")``
  cublaslt                 ``preferred_blas_library("cublaslt")``
  no_reduced_bf16          ``allow_bf16_reduced_precision_reduction = False``
  mm_transposed            ``x @ w.t()`` through ``torch.mm`` (the same GEMM by another entry)

The cuBLASLt workspace size is read once per process (``CUBLASLT_WORKSPACE_SIZE``, KiB): run the script
under two values to compare it.

    python bench/blas_choice.py --json OUT.json
    CUBLASLT_WORKSPACE_SIZE=65536 python bench/blas_choice.py --json OUT64.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

# (name, in_features, out_features) of Qwen3-0.6B's decoder linears, fused as the engine fuses them
SHAPES = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]


def _set(library: str = "default", reduced_bf16: bool = True) -> None:
    torch.backends.cuda.preferred_blas_library(library)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced_bf16


def switches(default_library) -> dict:
    """name -> (set the switches, the GEMM call given x [M, K] and w [N, K])."""
    linear = lambda x, w: F.linear(x, w)  # noqa: E731
    return {
        "default": (lambda: _set(default_library), linear),
        "cublas": (lambda: _set("cublas"), linear),
        "cublaslt": (lambda: _set("cublaslt"), linear),
        "no_reduced_bf16": (lambda: _set(default_library, reduced_bf16=False), linear),
        "mm_transposed": (lambda: _set(default_library), lambda x, w: torch.mm(x, w.t())),
    }


def main() -> int:
    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    default_library = torch.backends.cuda.preferred_blas_library()
    out = dict(provenance(" ".join(sys.argv)), cublaslt_workspace_kib=os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
               default_library=str(default_library), rows=[])
    choices = switches(default_library)
    for m in map(int, args.ms.split(",")):
        data = {name: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                       torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5) for name, k, n in SHAPES}
        ref = {name: F.linear(*data[name]).float() for name, _, _ in SHAPES}
        times = {(c, s): [] for c in choices for s, _, _ in SHAPES}
        diffs = {}
        for _ in range(args.repeats):
            for c, (apply, gemm) in choices.items():
                apply()
                for s, _, _ in SHAPES:
                    x, w = data[s]
                    times[(c, s)].append(do_bench_cudagraph(lambda: gemm(x, w), rep=30) * 1e3)
                    diffs[(c, s)] = (gemm(x, w).float() - ref[s]).abs().max().item()
        _set(default_library)
        for c in choices:
            us = {s: round(statistics.median(times[(c, s)]), 2) for s, _, _ in SHAPES}
            row = dict(m=m, choice=c, us=us, layer_us=round(sum(us.values()), 2),
                       max_abs_diff=max(diffs[(c, s)] for s, _, _ in SHAPES))
            out["rows"].append(row)
            per = "  ".join(f"{s} {u:5.2f}" for s, u in us.items())
            print(f"M={m:4d} {c:16s} layer {row['layer_us']:6.2f} us  {per}  diff {row['max_abs_diff']:.1e}",
                  flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
