"""RMSNorm backward with a grid wide enough for the trainer's shapes (the forward stays Liger's).

Liger's RMSNorm backward launches one program per SM (132 on an H200) and walks its share of the
rows in order, so at a GRPO update's row counts it is latency-bound: the hidden norms at
[36,736, 1,024] took 268 us a call and Qwen3's q_norm at [587,776, 128] 490 us, 5-9x their
bandwidth time (32 ms of a 0.47 s update; bench/RESULTS.md, issue 20). This kernel is the same
math (Liger's "llama" casting: inverse RMS in fp32, ``w * (x * rstd)`` in the input dtype) over
``BLOCK_ROW`` rows per tile, a grid of up to ``programs_per_sm`` programs per SM striding over
the tiles, each program's dW partial in fp32, summed once after. dX is written, not accumulated
(no zero fill).

    dx = rstd * m - rstd^3 / N * sum(m * x) * x,   m = dy * w          (fp32)
    dw = sum over rows of dy * cast(x * rstd)                             (fp32 partials)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from asyncrl.engine.triton_decode import num_sms


@triton.jit
def _rms_norm_backward_kernel(DY, X, W, RSTD, DX, DW, n_rows, n_cols, programs,
                              BLOCK_ROW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p of ``programs``: row tiles p, p + programs, ... of ``BLOCK_ROW`` rows (rows contiguous, ``n_cols`` apart);
    writes DX rows and DW[p, :] (fp32) = its tiles' dw."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_ROW, n_rows, programs * BLOCK_ROW):
        rows = start + tl.arange(0, BLOCK_ROW)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        m = dy.to(tl.float32) * w[None, :]
        dot = tl.sum(m * x, axis=1)
        dx = rstd[:, None] * m - ((rstd * rstd * rstd) * dot / n_cols)[:, None] * x
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        xhat = (x * rstd[:, None]).to(X.dtype.element_ty)  # the normalized input as the forward rounded it
        dw += tl.sum((dy * xhat).to(tl.float32), axis=0)
    tl.store(DW + pid * n_cols + cols, dw, mask=cmask)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      programs_per_sm: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x [R, N] (contiguous, the input dtype), weight [N], rstd [R] fp32 -> (dx [R, N] like x,
    dw [N] like weight)."""
    R, N = x.shape
    block_n = triton.next_power_of_2(N)
    block_row = max(1, min(32, 4096 // block_n))  # ~4k elements a tile: 32 rows of 128, 4 of 1,024
    tiles = triton.cdiv(R, block_row)
    grid = max(1, min(tiles, programs_per_sm * num_sms(x.device)))
    dx = torch.empty_like(x)
    partial = torch.empty(grid, N, dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(grid,)](dy, x, weight, rstd, dx, partial, R, N, grid, BLOCK_ROW=block_row,
                                       BLOCK_N=block_n, num_warps=4)
    return dx, partial.sum(0).to(weight.dtype)


@functools.lru_cache(maxsize=1)
def wide_rms_norm_function():
    """Liger's ``LigerRMSNormFunction`` with this backward (llama casting, a weight, no offset: the
    trainer's Qwen3/Qwen2/Llama/Mistral norms; any other configuration keeps Liger's backward)."""
    from liger_kernel.ops import LigerRMSNormFunction

    class WideRMSNormFunction(LigerRMSNormFunction):
        @staticmethod
        def backward(ctx, dY):
            if not (type(dY) is torch.Tensor and ctx.elementwise_affine and ctx.offset == 0.0
                    and ctx.casting_mode == _llama_mode()):  # (a DTensor gradient: Liger gathers it)
                return LigerRMSNormFunction.backward(ctx, dY)
            X, W, RSTD = ctx.saved_tensors
            shape = dY.shape
            dX, dW = rms_norm_backward(dY.reshape(-1, shape[-1]).contiguous(), X, W, RSTD)
            return dX.view(*shape), dW if ctx.needs_input_grad[1] else None, None, None, None, None, None

    return WideRMSNormFunction


def _llama_mode() -> int:
    from liger_kernel.ops.rms_norm import _str_to_casting_mode
    return _str_to_casting_mode["llama"]
