"""Per-token-group FP8 quantization of a linear layer's input, one Triton kernel (CUDA graph capturable).

``quantize_tokens_cuda(x [M, K], Kp) -> (q [Mp, Kp] e4m3, scale_t [Kp/128, Mp] fp32)``: the same numbers
as ``fp8.quantize_tokens`` (fp32 amax per 128 channels of a row, ``scale = max(amax, 1e-12) / 448``,
IEEE-rounded divisions, round-to-nearest-even to e4m3), laid out for ``F.scaled_mm``'s blockwise
path: rows padded to a multiple of 4 (zeros) and the scales M-major (``scale_t.t()`` is ``[Mp, Kb]``
with strides ``(1, Mp)``). Done in eager torch this is 5-6 kernels per linear, which cost more than the
FP8 GEMM saves (SCALE.md §4.4); here it is one launch per linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncrl.engine.fp8 import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, padded


@triton.jit
def _quantize_groups(x_ptr, q_ptr, s_ptr, M, K, stride_xm, Mp, Kp,
                     AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr):
    """Program (row, group): 128 channels of one row -> 128 e4m3 values and their fp32 scale."""
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=(row < M) & (cols < K), other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_MIN)
    scale = tl.math.div_rn(amax, QMAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
    tl.store(q_ptr + row * Kp + cols, q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + group * Mp + row, scale)


def quantize_tokens_cuda(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [Mp, Kp]`` e4m3, ``scale_t [Kp/128, Mp]`` fp32), ``Mp`` = M rounded up to 4."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    mp, groups = padded(max(m, 1), 4), k_padded // BLOCK
    q = torch.empty(mp, k_padded, dtype=FP8, device=x.device)
    scale_t = torch.empty(groups, mp, dtype=torch.float32, device=x.device)
    _quantize_groups[(mp, groups)](x, q, scale_t, m, k, x.stride(0), mp, k_padded,
                                   AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, GROUP=BLOCK, num_warps=1)
    return q, scale_t
