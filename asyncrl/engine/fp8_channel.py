"""FP8 (e4m3) per-channel weights x per-token activations: the "FP8 dynamic" recipe (llm-compressor's
``FP8_DYNAMIC``, compressed-tensors' ``channel`` weight / dynamic ``token`` activation strategy; what
vLLM serves with its CUTLASS rowwise-scaled GEMM on Hopper).

    weight  W [N, K] -> Wq [N, Kp] e4m3, Ws [N, 1] fp32    W ≈ Ws ⊙ Wq   (one scale per output channel)
    input   x [M, K] -> xq [M, Kp] e4m3, xs [M, 1] fp32    x ≈ xs ⊙ xq   (one scale per token, at run time)
    y = x Wᵀ ≈ xs · Wsᵀ ⊙ (xq Wqᵀ)                          (an outer product of scales: the GEMM's epilogue)

Against the blockwise recipe (``fp8.py``) the scales leave the K loop: the FP8 GEMM accumulates the
whole row in fp32 and multiplies once at the end, which is what cuBLAS/CUTLASS do fastest on sm90
(``torch._scaled_mm`` with ``scale_a [M, 1]``, ``scale_b [1, N]``). The price: one scale spans a
whole row instead of 128 values, so a row with one large outlier quantizes its small values more
coarsely (per element still within ``max(|v| 2^-4, scale 2^-10)``, the bound of ``fp8.py``).

Scales and rounding are ``fp8.py``'s (``scale = max(amax, 1e-12) / 448``, IEEE division, round to
nearest even, clamped to ±448). ``Kp`` pads the reduction dim to 16 (the FP8 GEMM's alignment); the
engine's layer pads rows to 16 (``fp8_linear.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.engine.fp8 import scale_of, to_fp8, padded

K_ALIGN = 16                    # FP8 GEMMs need K (and N) a multiple of 16


def padded_k(k: int) -> int:
    """The stored reduction dim for ``k`` input features (a multiple of :data:`K_ALIGN`)."""
    return padded(k, K_ALIGN)


@torch.no_grad()
def quantize_rows(t: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, K]`` (any float dtype) -> (``q [R, Kp]`` e4m3, ``scale [R, 1]`` fp32): one scale per row
    (a weight's output channel, or a token of the input), computed in fp32; columns padded with zeros."""
    rows = F.pad(t.float(), (0, k_padded - t.shape[1]))
    scale = scale_of(rows.abs().amax(dim=1, keepdim=True))
    return to_fp8(rows, scale), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, Kp]`` = ``q ⊙ scale`` (row by row)."""
    return q.float() * scale


def matmul_reference(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(Wq, Ws)ᵀ -> [M, N]`` in ``x.dtype``, x quantized per token first: what the
    FP8 GEMM computes, in fp32 with one rounding at the end (any device)."""
    xq, xs = quantize_rows(x, wq.shape[1])
    return (dequantize_rows(xq, xs) @ dequantize_rows(wq, ws).t()).to(x.dtype)


def matmul_scaled_mm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """The same product on a CUDA device (sm89+): one Triton kernel quantizes ``x`` per token, then
    ``torch._scaled_mm`` rowwise (CUTLASS on sm90; fp32 accumulation unless ``fast_accum``, Hopper's
    FP8 accumulator that drops low bits). Returns ``[M, N]`` in ``x.dtype`` (bf16)."""
    from asyncrl.engine.triton_fp8 import quantize_rows_cuda

    xq, xs = quantize_rows_cuda(x, wq.shape[1])                         # [M, Kp], [M, 1]
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=x.dtype, use_fast_accum=fast_accum)


def fp8_matmul(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``matmul_scaled_mm`` for bf16 inputs on CUDA (the engine's serving dtype), else the reference
    (CPU; an fp32 engine on a GPU, as the exactness tests run)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return matmul_scaled_mm(x, wq, ws)
    return matmul_reference(x, wq, ws)
