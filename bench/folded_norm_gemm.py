"""The RMSNorm folded out of a decode GEMM's prologue: is a plain TMA GEMM with the row scale in its epilogue as fast
as cuBLAS, so that the residual add + RMSNorm kernel can go (issue 23, GPU).

Session 53 measured ``triton_gemm``'s norm prologue (the normed rows built in registers tile by tile, fed to the
dots from registers) at 12.1 us for qkv and 21.8 us for gate_up + SwiGLU at 256 rows, where cuBLAS takes ~5.4 and
~7.0: the prologue, not the GEMM, is what lost. RMSNorm is ``w * h * r`` with ``r = rsqrt(mean(h^2) + eps)`` per row,
so ``rmsnorm(h) @ W^T = r * (h @ (W diag(w))^T)``: with the norm weight folded into the projection's weight once
(``W' = W diag(w)``, rounded to the model dtype) the GEMM reads the raw hidden state by TMA like any GEMM and
multiplies each output row by ``r`` (from ``linear_residual``'s sum-of-squares partials) in its epilogue. The
roundings differ from the engine's (and HF's): the normed rows are not rounded to bf16 before the product, and W'
is rounded once; this bench reports the difference from the engine's path beside the times.

Per projection at ``M`` rows (Qwen3-0.6B shapes, bf16, CUDA graphs): the engine's add + RMSNorm kernel + cuBLAS
(+ the SwiGLU kernel for gate_up) against the folded GEMM, at a few launches.

    python bench/folded_norm_gemm.py --ms 256,64 --json bench/results/folded_norm_gemm_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.triton_gemm import _descriptor, _row_rsqrt, linear_residual  # noqa: E402
from asyncrl.engine.triton_qkv import cast_rn  # noqa: E402
from asyncrl.engine.triton_silu import swiglu_rn  # noqa: E402

EPS = 1e-6
HIDDEN, INTER, QKV = 1024, 3072, 4096
LAUNCHES = [(64, 128, 128, 4, 3), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 32, 64, 4, 4),
            (128, 64, 64, 4, 3), (128, 128, 64, 8, 3)]


@triton.jit
def _folded_kernel(a_desc, w_desc, SS, C, M, N, K, P, eps, stride_ss, stride_c, INTER,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, SWIGLU: tl.constexpr):
    """``C = round(r * (H @ W'^T))`` on the program's tile (SWIGLU: gate and up rows, then SwiGLU), r per row from
    SS's P partials after the K loop (nothing before the loop holds back its TMA loads)."""
    m0 = tl.program_id(0) * BM
    n0 = tl.program_id(1) * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([m0, k0])
        acc = tl.dot(a, w_desc.load([n0, k0]).T, acc)
        if SWIGLU:
            acc_up = tl.dot(a, w_desc.load([INTER + n0, k0]).T, acc_up)
    m = m0 + tl.arange(0, BM)
    n = n0 + tl.arange(0, BN)
    live = (m < M)[:, None]
    r = _row_rsqrt(SS, m, live, stride_ss, P, K, eps, BP)
    DT: tl.constexpr = C.dtype.element_ty
    out = cast_rn(acc * r, DT)
    if SWIGLU:
        out = swiglu_rn(out.to(tl.float32), cast_rn(acc_up * r, DT).to(tl.float32), DT)
    tl.store(C + m.to(tl.int64)[:, None] * stride_c + n[None, :], out, mask=live & (n < N)[None, :])


def folded(h, ss, w_folded, inter, launch):
    bm, bn, bk, warps, stages = launch
    T, K = h.shape
    N = inter or w_folded.shape[0]
    out = torch.empty(T, N, dtype=h.dtype, device=h.device)
    _folded_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
        _descriptor(h, [bm, bk]), _descriptor(w_folded, [bn, bk]), ss, out, T, N, K, ss.shape[1], EPS, ss.stride(0),
        out.stride(0), inter or 0, BM=bm, BN=bn, BK=bk, BP=triton.next_power_of_2(ss.shape[1]),
        SWIGLU=inter is not None, num_warps=warps, num_stages=stages)
    return out


def measure(M: int, g: torch.Generator) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine.triton_norm import rms_norm
    from asyncrl.engine.triton_silu import silu_and_mul

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(M, 2048, device=dev, generator=g).to(dt)  # the o projection's input
    w_o = (torch.randn(HIDDEN, 2048, device=dev, generator=g) / 2048 ** 0.5).to(dt)
    residual = torch.randn(M, HIDDEN, device=dev, generator=g).to(dt)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=g)).to(dt)
    h, ss = linear_residual(x, w_o, residual)  # what the o GEMM's epilogue gives the next GEMM
    o_out = F.linear(x, w_o)  # what the engine's add + RMSNorm kernel takes
    rows = []
    for name, n_out, inter in (("qkv", QKV, None), ("gate_up + SwiGLU", 2 * INTER, INTER)):
        w = (torch.randn(n_out, HIDDEN, device=dev, generator=g) / HIDDEN ** 0.5).to(dt)
        w_folded = (w.float() * norm_w.float()[None, :]).to(dt)

        def engine():
            normed, _ = rms_norm(o_out, norm_w, EPS, residual)
            y = F.linear(normed, w)
            return silu_and_mul(y, inter) if inter else y

        ref = engine().float()
        row = dict(m=M, projection=name, engine_us=round(do_bench_cudagraph(engine, rep=50) * 1e3, 2))
        best = None
        for launch in LAUNCHES:
            try:
                got = folded(h, ss, w_folded, inter, launch)
                us = do_bench_cudagraph(lambda: folded(h, ss, w_folded, inter, launch), rep=50) * 1e3
            except Exception as exc:  # noqa: BLE001 - out of resources: not a candidate
                print(f"  {name} {launch}: {repr(exc)[:100]}", flush=True)
                continue
            diff = (got.float() - ref).abs()
            if best is None or us < best["us"]:
                best = dict(launch=launch, us=round(us, 2), max_abs_diff=diff.max().item(),
                            frac_differ=round((diff > 0).float().mean().item(), 4),
                            max_rel_diff=(diff / ref.abs().clamp_min(1e-2)).max().item())
        row["folded"] = best
        row["x_engine"] = round(row["engine_us"] / best["us"], 3)
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="256,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = dict(provenance(" ".join(sys.argv)), rows=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    for M in map(int, args.ms.split(",")):
        out["rows"] += measure(M, g)
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
