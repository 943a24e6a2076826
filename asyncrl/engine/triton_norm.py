"""The decoder's RMSNorm, with the residual add before it, as one Triton kernel.

``x [T, N]`` (and ``residual [T, N]``) -> ``norm(x + residual)`` and ``x + residual``, or ``norm(x)``. The compiled
torch path (``decoder._rms_norm`` / ``decoder._add_rms_norm`` through Inductor) is the reference and the CPU path;
this kernel holds ``BLOCK_T`` whole rows per program, so a decode step's few hundred rows take a few wide
programs (``norm_launch`` picks them by row count).

Numbers: the same roundings as the torch path: the residual sum rounded to the model dtype, ``x * rsqrt(mean(x^2)
+ eps)`` in fp32 rounded to the model dtype, the product with the weight (model dtype) rounded once (a product of
two bf16 values is exact in fp32). Left to differ: the order of the mean's sum (a few fp32 ulps, inside one
rounding of the model dtype).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from asyncrl.engine.triton_qkv import cast_rn, rsqrt_f32  # libdevice's rsqrtf and nearest-even casts (interpreter too)


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, RES_OUT, T, N, eps, stride_x, stride_res, stride_out,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    """Program (row block): rows ``pid * BLOCK_T ...``, each whole (``BLOCK_N >= N``)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    mask = (t < T)[:, None] & (n < N)[None, :]
    rows = t.to(tl.int64)[:, None]
    DT: tl.constexpr = OUT.dtype.element_ty
    x = tl.load(X + rows * stride_x + n[None, :], mask=mask, other=0.0)
    if ADD:
        x = cast_rn(x.to(tl.float32) + tl.load(RES + rows * stride_res + n[None, :], mask=mask, other=0.0).to(
            tl.float32), DT)
        tl.store(RES_OUT + rows * stride_out + n[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    r = rsqrt_f32(tl.sum(xf * xf, 1) / N + eps)[:, None]
    w = tl.load(W + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y = cast_rn(cast_rn(xf * r, DT).to(tl.float32) * w, DT)
    tl.store(OUT + rows * stride_out + n[None, :], y, mask=mask)


def norm_launch(tokens: int) -> tuple[int, int]:
    """(rows per program, warps) for ``tokens`` rows. Timed on an H200 at hidden 1,024 with the residual add
    (bench/glue_kernels.py, 2026-12-04 session 48, 9 launches, CUDA-graph replay): one row on one warp is the fastest
    at 64-256 rows (1.33-1.43x Inductor's kernel: 2.2 -> 1.6 us at 188 rows), one row on 4 warps within 1% of the
    best at 1k-16k (1.4-2.1x)."""
    return (1, 1) if tokens <= 512 else (1, 4)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
             launch: Optional[tuple[int, int]] = None):
    """``decoder._rms_norm(x, weight, eps)``, or with ``residual`` ``decoder._add_rms_norm``: ``(norm(x +
    residual), x + residual)``. ``x``, ``residual`` ``[T, N]`` (columns contiguous), ``weight [N]`` in x's dtype.
    ``launch``: (rows per program, warps), default ``norm_launch(T)``."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (stride {x.stride()}) is not [T, N] with contiguous columns "
                         f"and a weight of [N] ({tuple(weight.shape)})")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} (stride {residual.stride()}) is not x's "
                         f"{tuple(x.shape)} with contiguous columns")
    T, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else out
    if T:
        block_t, warps = launch or norm_launch(T)
        res = residual if residual is not None else x
        _rms_norm_kernel[(triton.cdiv(T, block_t),)](
            x, res, weight, out, res_out, T, N, eps, x.stride(0), res.stride(0), out.stride(0),
            BLOCK_T=block_t, BLOCK_N=triton.next_power_of_2(N), ADD=residual is not None, num_warps=warps)
    return (out, res_out) if residual is not None else out
