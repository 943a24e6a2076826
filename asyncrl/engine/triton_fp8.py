"""FP8 quantization of a linear layer's input, one Triton kernel per linear (CUDA graph capturable).

One program per row (several warps): the row is loaded once, its amax taken per 128-channel group
(blockwise recipe, ``fp8.py``) or over the whole row (per-token recipe, ``fp8_channel.py``), then
scaled, rounded to e4m3 and stored, in one pass. The numbers equal the torch references bit for bit
(fp32 amax, ``scale = max(amax, 1e-12) / 448``, IEEE-rounded divisions, round-to-nearest-even):

  ``quantize_tokens_cuda(x [M, K], Kp) -> (q [Mp, Kp], scale_t [Kp/128, Mp])``  = ``fp8.quantize_tokens``,
      laid out for ``F.scaled_mm``'s blockwise path: rows padded to a multiple of 4 (zeros), scales
      M-major (``scale_t.t()`` is ``[Mp, Kb]`` with strides ``(1, Mp)``)
  ``quantize_rows_cuda(x [M, K], Kp) -> (q [M, Kp], scale [M, 1])``  = ``fp8_channel.quantize_rows``,
      as ``torch._scaled_mm``'s rowwise path reads them

The kernel rounds to e4m3's grid in fp32 (``_round_to_e4m3``) before the cast: the value it casts is
then exact, so the hardware conversion (round-to-nearest-even) has nothing left to round, and the
Triton interpreter -- whose own fp32 -> e4m3 conversion truncates (124.3 -> 64, -100 -> -104) --
gives the GPU's numbers; that is how the CPU tests check this kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncrl.engine.fp8 import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, padded

MAX_ROW = 1 << 16               # channels one program holds (a row of 65,536 fp32: 32 per thread at 16 warps)


@triton.jit
def _round_to_e4m3(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even: between 2^e and 2^(e+1)
    e4m3 steps by 2^(e-3); below 2^-6 (subnormals) by 2^-9. ``|v| / step`` is exact (a power of two)
    and adding then subtracting 1.5 * 2^23 rounds it to an integer the IEEE way (|v| / step < 16);
    the sign is put back afterwards, so a tiny negative value becomes -0 as the hardware cast makes it."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(v) / step + 12582912.0) - 12582912.0) * step
    return rounded * tl.where(bits < 0, -1.0, 1.0)          # a product: -(+0) is -0 (0 - x would give +0)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, M, K, Kp, stride_xm, stride_sm, stride_sg,
                   AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``row``: ``x[row, :K]`` -> ``q[row, :Kp]`` (zeros past K) and one fp32 scale per ``GROUP``
    channels at ``s_ptr + row * stride_sm + group * stride_sg`` (``GROUP == BLOCK_K``: one per row).
    Rows ``>= M`` (padding) read zeros."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=(row < M) & (cols < K), other=0.0).to(tl.float32)
    if GROUP == BLOCK_K:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_MIN), QMAX)
        q = tl.math.div_rn(x, scale)
        tl.store(s_ptr + row * stride_sm, scale)
    else:
        groups = tl.reshape(x, (BLOCK_K // GROUP, GROUP))
        scales = tl.math.div_rn(tl.maximum(tl.max(tl.abs(groups), axis=1), AMAX_MIN), QMAX)   # [BLOCK_K / GROUP]
        q = tl.reshape(tl.math.div_rn(groups, scales[:, None]), (BLOCK_K,))
        g = tl.arange(0, BLOCK_K // GROUP)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scales, mask=g * GROUP < Kp)
    q = _round_to_e4m3(tl.clamp(q, -QMAX, QMAX))
    tl.store(q_ptr + row * Kp + cols, q.to(q_ptr.dtype.element_ty), mask=cols < Kp)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, stride_sm: int, stride_sg: int,
            group: int) -> None:
    m, k = x.shape
    rows, kp = q.shape
    if rows == 0:
        return
    block_k = triton.next_power_of_2(kp)
    if block_k > MAX_ROW:
        raise ValueError(f"FP8 activation quantization holds a row of at most {MAX_ROW} channels; got {kp}")
    warps = 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16
    _quantize_rows[(rows,)](x, q, scale, m, k, kp, x.stride(0), stride_sm, stride_sg, AMAX_MIN=AMAX_FLOOR,
                            QMAX=FP8_MAX, GROUP=block_k if group == 0 else group, BLOCK_K=block_k, num_warps=warps)


def quantize_tokens_cuda(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [Mp, Kp]`` e4m3, ``scale_t [Kp/128, Mp]`` fp32), ``Mp`` = M rounded up to 4:
    one scale per token per 128 channels (the blockwise recipe)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    mp = padded(max(x.shape[0], 1), 4)
    q = torch.empty(mp, k_padded, dtype=FP8, device=x.device)
    scale_t = torch.empty(k_padded // BLOCK, mp, dtype=torch.float32, device=x.device)
    _launch(x, q, scale_t, stride_sm=1, stride_sg=mp, group=BLOCK)
    return q, scale_t


def quantize_rows_cuda(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [M, Kp]`` e4m3, ``scale [M, 1]`` fp32): one scale per token (the per-token
    recipe)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(x.shape[0], k_padded, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch(x, q, scale, stride_sm=1, stride_sg=0, group=0)
    return q, scale
