"""Paged-decode attention under Nsight Compute: one profiled launch per (K/V dtype, launch) at one shape.

The kernels are compiled and run once outside the profiled range, then each runs once between
``cudaProfilerStart`` / ``cudaProfilerStop``, so ``ncu --profile-from-start off`` records exactly those
launches (one per row, in the order printed). The shape and cache are ``paged_decode_variants``'s
(Qwen3-0.6B: 16 q heads, 8 kv heads, D 128, block 64, blocks scattered over the pool).

    ncu --clock-control none --profile-from-start off --set full --import-source yes \\
        -k regex:_paged_decode_kernel -o decode python bench/decode_ncu.py --shape 256x384
    ncu -i decode.ncu-rep --page details          # per launch: throughput, occupancy, warp stalls
    ncu -i decode.ncu-rep --page source --print-source sass --csv   # stalls per SASS instruction
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paged_decode_variants import D, VARIANTS  # noqa: E402
from paged_decode_sweep import case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="256x384", help="BATCHxCONTEXT")
    ap.add_argument("--rows", default="bfloat16:base prefetch lpt,float8_e4m3fn:base prefetch tile16 w1 s3 lpt",
                    help="comma-separated DTYPE:VARIANT (names of paged_decode_variants.VARIANTS)")
    args = ap.parse_args()
    from asyncrl.engine.triton_decode import longest_first_order, paged_decode_attention

    batch, context = map(int, args.shape.split("x"))
    q, kc, vc, bt, lens = case(batch, context)
    order = longest_first_order(lens)
    calls = []
    for row in args.rows.split(","):
        dtype_name, variant = row.split(":")
        dtype = getattr(torch, dtype_name)
        k, v, launch = kc.to(dtype), vc.to(dtype), VARIANTS[variant]
        calls.append((row, lambda k=k, v=v, launch=launch: paged_decode_attention(
            q, k, v, bt, lens, D ** -0.5, launch=launch, order=lambda: order)))
    for _, call in calls:  # compile and warm outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls:
        call()
        torch.cuda.synchronize()
        print(f"profiled: {args.shape} {name}", flush=True)
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
