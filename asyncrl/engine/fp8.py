"""FP8 (e4m3) blockwise quantization and the W8A8 matmul: DeepSeek-V3's / vLLM's "fp8 block" recipe.

    weight  W [N, K] -> Wq [Np, Kp] e4m3, Ws [Np/128, Kp/128] fp32   W ≈ Wq ⊙ Ws (one scale per 128x128 block)
    input   x [M, K] -> xq [M, Kp]  e4m3, xs [M, Kp/128] fp32        x ≈ xq ⊙ xs (one scale per token per 128
                                                                     channels, computed at run time)
    y = x Wᵀ ≈ Σ_g xs[:, g] · Ws[:, g]ᵀ ⊙ (xq[:, g] · Wq[:, g]ᵀ)

Scales are "multiply on dequantize" (DeepSeek's ``weight_scale_inv``): ``scale = max(amax, 1e-12) / 448``,
so the largest value of a block maps to ±448, e4m3's largest finite value, and an all-zero block
gives zeros instead of NaN. ``Np`` pads rows to 128; ``Kp`` pads the reduction dim to 512 (128-wide
groups, a multiple of 4 of them: cuBLAS wants the scales' leading dimension 16-byte aligned); padding
is zeros and changes no output.

Two matmuls:
  ``fp8_matmul_reference``  quantize x the same way, dequantize both to fp32, one fp32 GEMM: any device
                            (the CPU path, and what the GPU path is tested against)
  ``fp8_matmul_scaled_mm``  CUDA (Hopper+): x quantized by a Triton kernel (``triton_fp8.py``), then
                            ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` (x) and
                            ``BlockWise128x128`` (W) scales: cuBLAS's blockwise-scaled FP8 GEMM, fp32
                            accumulation, bf16 out
Error of one element (hand-checkable): e4m3 keeps 3 mantissa bits, so a normal value is rounded to
within half a unit in the last place, ``|v| · 2^-4``; below e4m3's smallest normal (2^-6 in scaled
units) the spacing is 2^-9, so the error is at most ``scale · 2^-10``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128                     # weight blocks are BLOCK x BLOCK; activation groups 1 x BLOCK
K_ALIGN = 4 * BLOCK             # the reduction dim is padded to this (4 scale groups)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # largest finite e4m3fn value
AMAX_FLOOR = 1e-12              # an all-zero block/group gets this amax: zeros, not NaN


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_k(k: int) -> int:
    """The stored reduction dim for ``k`` input features (a multiple of :data:`K_ALIGN`)."""
    return padded(k, K_ALIGN)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    # The divisor is a tensor on amax's device: PyTorch's CUDA kernels turn a division by a Python
    # scalar into a multiplication by its reciprocal (1 ulp off the IEEE quotient the Triton kernel
    # and the CPU compute; seen on the H200 as scales differing in the last bit). ``full_like`` fills
    # it on the device (no host copy: capturable in a CUDA graph).
    return amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)


def to_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values / scale`` rounded to e4m3 (fp32 division; clamped: 448.00003 must not become NaN)."""
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@torch.no_grad()
def quantize_weight(w: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, K]`` (any float dtype) -> (``q [Rp, Kp]`` e4m3, ``scale [Rp/128, Kp/128]`` fp32), rows
    padded to 128 and columns to ``k_padded``; computed in fp32 on ``w``'s device."""
    rows, k = w.shape
    rp = padded(rows, BLOCK)
    full = F.pad(w.float(), (0, k_padded - k, 0, rp - rows))
    blocks = full.view(rp // BLOCK, BLOCK, k_padded // BLOCK, BLOCK)
    scale = scale_of(blocks.abs().amax(dim=(1, 3)))                      # [Rb, Kb]
    q = to_fp8(blocks, scale[:, None, :, None]).view(rp, k_padded)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[Rp, Kp]`` = ``q ⊙ scale`` broadcast over each 128 x 128 block."""
    rb, kb = scale.shape
    return (q.float().view(rb, BLOCK, kb, BLOCK) * scale[:, None, :, None]).view(q.shape)


@torch.no_grad()
def quantize_tokens(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [M, Kp]`` e4m3, ``scale [M, Kp/128]`` fp32): one scale per token per 128
    channels (the torch reference of ``triton_fp8.quantize_tokens``)."""
    m, k = x.shape
    groups = F.pad(x.float(), (0, k_padded - k)).view(m, k_padded // BLOCK, BLOCK)
    scale = scale_of(groups.abs().amax(dim=2))                           # [M, Kb]
    return to_fp8(groups, scale[:, :, None]).view(m, k_padded), scale


def dequantize_tokens(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, kp = q.shape
    return (q.float().view(m, kp // BLOCK, BLOCK) * scale[:, :, None]).view(m, kp)


def fp8_matmul_reference(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(Wq, Ws)ᵀ -> [M, Np]`` in ``x.dtype``, with x quantized per token group first
    (so it computes what the FP8 GEMM computes, in fp32 with one rounding at the end)."""
    xq, xs = quantize_tokens(x, wq.shape[1])
    return (dequantize_tokens(xq, xs) @ dequantize_weight(wq, ws).t()).to(x.dtype)


def fp8_matmul_scaled_mm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The same product on a CUDA device: Triton group quantization of ``x`` (rows padded to a multiple
    of 4, scales written M-major as cuBLAS reads them) and one blockwise-scaled cuBLAS FP8 GEMM.
    Returns ``[M, Np]`` in ``x.dtype`` (bf16)."""
    from asyncrl.engine.triton_fp8 import quantize_tokens_cuda

    m = x.shape[0]
    xq, xs_t = quantize_tokens_cuda(x, wq.shape[1])                       # [Mp, Kp], [Kb, Mp]
    out = F.scaled_mm(xq, wq.t(), xs_t.t(), F.ScalingType.BlockWise1x128, ws.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=x.dtype)
    return out[:m]


def fp8_matmul(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``fp8_matmul_scaled_mm`` for bf16 inputs on CUDA (the engine's serving dtype), else
    ``fp8_matmul_reference`` (CPU; an fp32 engine on a GPU, as the exactness tests run)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return fp8_matmul_scaled_mm(x, wq, ws)
    return fp8_matmul_reference(x, wq, ws)


def check_fp8_device(device: torch.device, what: str, capability: tuple[int, int]) -> None:
    """Say at build time (not inside a CUDA graph capture) that ``device`` lacks what an FP8 path
    needs: FP8 conversions from compute capability 8.9 (Ada), cuBLAS's blockwise-scaled FP8 GEMM
    from 9.0 (Hopper). CPU runs the reference paths."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < capability:
        found = torch.cuda.get_device_capability(device)
        raise ValueError(f"{what} needs a GPU of compute capability {capability[0]}.{capability[1]}+; "
                         f"{torch.cuda.get_device_name(device)} is {found[0]}.{found[1]}: leave it unset there")
