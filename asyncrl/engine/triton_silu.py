"""SwiGLU's ``silu(gate) * up`` as one Triton kernel over the gate_up GEMM's output.

``gate_up [T, 2I]`` (gate columns then up columns, rows may be strided) -> ``[T, I]``. The compiled torch
path (``decoder._silu_and_mul`` through Inductor) is the reference and the CPU path; this kernel tiles
``[BLOCK_T, BLOCK_C]`` (``silu_launch`` picks the tile by row count) so that a prefill step's 16k rows stream
at the card's bandwidth (Inductor's flat pointwise kernel read them at ~1.6 TB/s on an H200, this one at ~4.2;
bench/glue_kernels.py, bench/RESULTS.md 2026-12-04 session 48).

Numbers: eager torch's (what HF's ``act_fn(gate_proj(x)) * up_proj(x)`` runs): ``silu`` in fp32 as
``g / (1 + exp(-g))`` with an accurate ``expf`` and a rounded division, rounded to the model dtype, then the
product of two model-dtype values rounded once. Inductor keeps the fp32 silu unrounded; the kernel follows
eager (and HF) instead. The interpreter (CPU tests) uses numpy's exp and division.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from asyncrl.engine.triton_qkv import cast_rn  # rounds to nearest-even in the interpreter too

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    @triton.jit
    def _silu(g):
        return g / (1.0 + tl.exp(-g))
else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _silu(g):
        return libdevice.div_rn(g, 1.0 + libdevice.exp(-g))  # expf and an IEEE division, as torch's CUDA silu


@triton.jit
def swiglu_rn(gate, up, DT: tl.constexpr):
    """``round(round(silu(gate)) * up)`` in DT from fp32 values of the model dtype ``DT`` (eager torch's roundings);
    ``triton_gemm`` applies it in gate_up's epilogue."""
    act = cast_rn(_silu(gate), DT)
    return cast_rn(act.to(tl.float32) * up, DT)


@triton.jit
def _silu_mul_kernel(GU, OUT, T, I, stride_gu, stride_out,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (token block, column block): ``OUT[t, c] = round(round(silu(GU[t, c])) * GU[t, I + c])``."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t < T)[:, None] & (c < I)[None, :]
    row = GU + t.to(tl.int64)[:, None] * stride_gu + c[None, :]
    gate = tl.load(row, mask=mask, other=0.0)
    up = tl.load(row + I, mask=mask, other=0.0)
    out = swiglu_rn(gate.to(tl.float32), up.to(tl.float32), OUT.dtype.element_ty)
    tl.store(OUT + t.to(tl.int64)[:, None] * stride_out + c[None, :], out, mask=mask)


def silu_launch(tokens: int) -> tuple[int, int, int]:
    """(tokens per program, columns per program, warps) for ``tokens`` rows. Timed on an H200 at Qwen3-0.6B's
    intermediate size 3,072 (bench/glue_kernels.py, 2026-12-04 session 48, 13 launches, CUDA-graph replay): one row
    of 512 columns on 4 warps is the fastest at 64-256 rows (1.26-1.99x Inductor's kernel), one row of 1,024 at
    1k-16k (2.7-3.0x; 16k rows 0.196 -> 0.072 ms, ~4.2 TB/s)."""
    return (1, 512, 4) if tokens <= 512 else (1, 1024, 4)


def silu_and_mul(gate_up: torch.Tensor, inter: int, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]``: ``[T, 2 inter]`` (columns contiguous) -> ``[T, inter]``
    in gate_up's dtype. ``launch``: (tokens per program, columns per program, warps), default ``silu_launch(T)``."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} (stride {gate_up.stride()}) is not "
                         f"[T, 2 * {inter}] with contiguous columns")
    T = gate_up.shape[0]
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block_t, block_c, warps = launch or silu_launch(T)
    grid = (triton.cdiv(T, block_t), triton.cdiv(inter, block_c))
    _silu_mul_kernel[grid](gate_up, out, T, inter, gate_up.stride(0), out.stride(0),
                           BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps)
    return out
