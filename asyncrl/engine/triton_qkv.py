"""One Triton kernel from the qkv GEMM's output to attention's inputs: q normed and rotated,
k normed, rotated and written into the paged cache, v written into the cache.

The compiled torch path (``decoder._qkv_prepare`` then ``attention.store_kv``) takes five kernels
per layer at decode: q/k norm + RoPE (two), ``v.contiguous()`` and two ``index_copy_`` into the
cache, ~12 us of an H200's ~80 us per layer in the GRPO-shaped decode (batch 128, Qwen3-0.6B).
This one reads ``qkv [T, (H + 2 Hkv) D]`` once and writes ``q [T, H, D]`` and the two caches'
slots in place (``EngineConfig.fused_kv_write``; the torch path stays the reference).

Grid: (token block, head h) with ``h < H`` a query head and ``h >= H`` kv head ``h - H``, whose program
also copies that head's v. A program holds one head's two halves ``[BLOCK_T, HALF]`` for its block of tokens
(rotate-half RoPE pairs element i with i + HALF) in fp32; ``qkv_launch`` picks the block by row count.

Numbers: the same roundings as the eager torch path. ``_rms_norm`` rounds ``x * rsqrt(mean(x^2) +
eps)`` to the model dtype, multiplies by the weight in that dtype (a product of two bf16 values is
exact in fp32, so fp32 product + one rounding is torch's bf16 multiply); ``_rotate`` computes in
fp32 from the rounded normed values and rounds once; ``_to_cache`` clamps to +-448 before an FP8
cache's cast. Left to differ: the order of the mean's sum and fused multiply-adds in RoPE (a few
fp32 ulps, inside one bf16 rounding). ``rsqrt`` is libdevice's ``rsqrtf`` (what torch's CUDA
``rsqrt`` calls); numpy's in the interpreter.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from asyncrl.engine.attention import FP8_KV, FP8_KV_MAX

# The interpreter (TRITON_INTERPRET=1, CPU tests) has no libdevice, and its fp32 -> bf16 / fp8 casts
# truncate (its round-to-nearest option drops the carry into the exponent): there ``cast_rn`` rounds to
# nearest-even in fp32 first, so the truncating cast is exact and the CPU tests see the GPU's numbers.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    @triton.jit
    def rsqrt_f32(x):
        return 1.0 / tl.sqrt(x)

    @triton.jit
    def _round_bits(x, DROP: tl.constexpr, KEEP_MASK: tl.constexpr):
        """fp32 ``x`` rounded to nearest-even with its low ``DROP`` mantissa bits cleared (normal numbers)."""
        b = x.to(tl.uint32, bitcast=True)
        b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) & KEEP_MASK
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def cast_rn(x, T: tl.constexpr):
        if T == tl.bfloat16:
            x = _round_bits(x, 16, 0xFFFF0000)
        elif T == tl.float16:  # 10 mantissa bits (normal numbers)
            x = _round_bits(x, 13, 0xFFFFE000)
        elif T == tl.float8e4nv:  # 3 mantissa bits; below 2^-6 subnormal steps of 2^-9 (magic-number rint)
            x = tl.where(tl.abs(x) < 0.015625, ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0,
                         _round_bits(x, 20, 0xFFF00000))
        return x.to(T)
else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def rsqrt_f32(x):
        return libdevice.rsqrt(x)  # rsqrtf: what torch.rsqrt runs on CUDA

    @triton.jit
    def cast_rn(x, T: tl.constexpr):
        return x.to(T)  # fp32 -> bf16 / fp16 / e4m3: round to nearest-even, as torch


@triton.jit
def _head_norm(x1, x2, W, i, imask, eps, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr):
    """``decoder._rms_norm`` of one head of ``BLOCK_T`` tokens held as its halves ``[BLOCK_T, BLOCK_HALF]``
    fp32 -> the same, rounded through the model dtype ``DT`` as torch rounds."""
    r = rsqrt_f32((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
    w1 = tl.load(W + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    y1 = cast_rn(cast_rn(x1 * r, DT).to(tl.float32) * w1, DT).to(tl.float32)
    y2 = cast_rn(cast_rn(x2 * r, DT).to(tl.float32) * w2, DT).to(tl.float32)
    return y1, y2


@triton.jit
def _rope(x1, x2, COS, SIN, pos, col, mask, stride_rope, HALF: tl.constexpr, DT: tl.constexpr):
    """``decoder._rotate`` of one head's halves ``[BLOCK_T, BLOCK_HALF]`` fp32 at positions ``pos [BLOCK_T]`` (the
    tokens' loaded positions) -> the rotated halves rounded to ``DT``: ``x * cos + cat(-x2, x1) * sin``."""
    pos = pos.to(tl.int64)[:, None] * stride_rope
    cos1 = tl.load(COS + pos + col, mask=mask, other=0.0)
    cos2 = tl.load(COS + pos + HALF + col, mask=mask, other=0.0)
    sin1 = tl.load(SIN + pos + col, mask=mask, other=0.0)
    sin2 = tl.load(SIN + pos + HALF + col, mask=mask, other=0.0)
    return cast_rn(x1 * cos1 + (-x2) * sin1, DT), cast_rn(x2 * cos2 + x1 * sin2, DT)


@triton.jit
def _to_cache(x, CT: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """``attention._to_cache``: a value in the model dtype, in the cache's (the same, or e4m3 saturated)."""
    if FP8:
        x = cast_rn(tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX), CT)
    return x


@triton.jit
def _cache_slots(slot, head, col, stride_cs, stride_ch):
    """Offsets ``[BLOCK_T, BLOCK_HALF]`` into a cache of kv head ``head``'s first half at ``slot [BLOCK_T]`` (the
    tokens' loaded slots)."""
    return slot.to(tl.int64)[:, None] * stride_cs + head * stride_ch + col


@triton.jit
def _store_halves(C, offs, y1, y2, mask, HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """A head's halves (model dtype) into cache C at ``offs`` (``_cache_slots``), as ``_to_cache`` casts them."""
    CT: tl.constexpr = C.dtype.element_ty
    tl.store(C + offs, _to_cache(y1, CT, FP8, FP8_MAX), mask=mask)
    tl.store(C + offs + HALF, _to_cache(y2, CT, FP8, FP8_MAX), mask=mask)


@triton.jit
def _norm_rope_head(x1, x2, h, pos, i, imask, col, mask, COS, SIN, QW, KW, eps, stride_rope,
                    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
    """Head h's halves ``[BLOCK_T, BLOCK_HALF]`` (fp32 values of the model dtype) of tokens at positions ``pos``,
    normed (q heads h < H by QW, kv heads by KW; NORM) and rotated -> the halves in the model dtype ``DT``."""
    if NORM:
        if h < H:
            x1, x2 = _head_norm(x1, x2, QW, i, imask, eps, D, HALF, DT)
        else:
            x1, x2 = _head_norm(x1, x2, KW, i, imask, eps, D, HALF, DT)
    return _rope(x1, x2, COS, SIN, pos, col, mask, stride_rope, HALF, DT)


@triton.jit
def _qkv_cache_kernel(QKV, POS, COS, SIN, QW, KW, Q, KC, VC, SLOT, eps, T,
                      stride_qkv, stride_qt, stride_qh, stride_rope, stride_cs, stride_ch,
                      H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                      FP8_MAX: tl.constexpr):
    """Program (token block tb, head h): tokens ``tb * BLOCK_T ...`` of q head h (h < H), else of kv head
    h - H (k and v). Tiles ``[BLOCK_T, BLOCK_HALF]``, one row per token."""
    tb = tl.program_id(0)
    h = tl.program_id(1)
    DT: tl.constexpr = Q.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    imask = i < HALF
    mask = tmask[:, None] & imask[None, :]
    col = i[None, :]
    # q heads then k heads: head h starts at column h * D
    row = QKV + t.to(tl.int64)[:, None] * stride_qkv + h * D
    x1 = tl.load(row + col, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + col, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(POS + t, mask=tmask, other=0)
    o1, o2 = _norm_rope_head(x1, x2, h, pos, i, imask, col, mask, COS, SIN, QW, KW, eps, stride_rope, H, D, HALF,
                             NORM, DT)
    if h < H:
        out = Q + t.to(tl.int64)[:, None] * stride_qt + h * stride_qh + col
        tl.store(out, o1, mask=mask)
        tl.store(out + HALF, o2, mask=mask)
    else:
        slot = _cache_slots(tl.load(SLOT + t, mask=tmask, other=0), h - H, col, stride_cs, stride_ch)
        _store_halves(KC, slot, o1, o2, mask, HALF, FP8, FP8_MAX)
        v_src = row + HKV * D + col  # v head h - H: column (H + HKV + h - H) * D = (h + HKV) * D
        _store_halves(VC, slot, tl.load(v_src, mask=mask, other=0.0), tl.load(v_src + HALF, mask=mask, other=0.0),
                      mask, HALF, FP8, FP8_MAX)


def check_tables(caller: str, dtype: torch.dtype, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise unless the RoPE tables are ``[max_pos, head_dim]`` rows with contiguous columns and the caches
    ``[num_blocks + 1, block_size, Hkv, D]`` hold ``dtype`` (or FP8 e4m3) in one layout a slot index addresses
    (``slot * stride(1) + head * stride(2) + d``)."""
    if cos.shape[1] != head_dim or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"{caller}: RoPE tables {tuple(cos.shape)} (strides {cos.stride()}, {sin.stride()}) are "
                         f"not [max_pos, D={head_dim}] rows with contiguous columns")
    if k_cache.dtype not in (dtype, FP8_KV):
        raise ValueError(f"{caller}: a {k_cache.dtype} cache for a {dtype} model (the model's dtype or "
                         "float8_e4m3fn)")
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1)):
        raise ValueError(f"{caller}: caches of strides {k_cache.stride()}, {v_cache.stride()} are not "
                         "one slot-addressable layout")


def qkv_launch(tokens: int) -> tuple[int, int]:
    """(tokens per program, warps) for ``tokens`` rows. Timed on an H200 at Qwen3-0.6B's heads (bench/glue_kernels.py,
    2026-12-04 session 48, CUDA-graph replay): 4 tokens on 4 warps is the fastest of 12 launches at 64-256 rows
    (1.16-1.91x one token on one warp, the launch before), 8 on 4 within 2% of the best at 1k-16k (2.7-3.1x:
    a prefill's 16k rows 0.238 -> 0.080 ms, ~3.4 TB/s)."""
    return (4, 4) if tokens <= 512 else (8, 4)


def qkv_to_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_norm_w: Optional[torch.Tensor], k_norm_w: Optional[torch.Tensor], eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, launch: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``decoder._qkv_prepare`` + ``attention.store_kv`` in one launch: qkv ``[T, (H + 2 Hkv) D]``
    (rows may be strided, columns contiguous), positions / slot_mapping ``[T]``, cos / sin
    ``[max_pos, D]`` fp32, caches ``[num_blocks + 1, block_size, Hkv, D]`` (model dtype or FP8 e4m3)
    -> q ``[T, H, D]`` in qkv's dtype; k and v land in the caches at ``slot_mapping``. ``launch``: (tokens
    per program, warps), default ``qkv_launch(T)``."""
    T = qkv.shape[0]
    D = head_dim
    if D % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or qkv.stride(1) != 1:
        raise ValueError(f"qkv_to_cache: qkv {tuple(qkv.shape)} (stride {qkv.stride()}) is not "
                         f"[T, (H + 2 Hkv) * D] with contiguous columns and an even D "
                         f"(H={num_heads}, Hkv={num_kv_heads}, D={D})")
    check_tables("qkv_to_cache", qkv.dtype, D, cos, sin, k_cache, v_cache)
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    norm = q_norm_w is not None
    qw = q_norm_w if norm else cos  # unused pointers when there is no norm
    kw = k_norm_w if norm else cos
    half = D // 2
    block_t, warps = launch or qkv_launch(T)
    _qkv_cache_kernel[(triton.cdiv(T, block_t), num_heads + num_kv_heads)](
        qkv, positions, cos, sin, qw, kw, q, k_cache, v_cache, slot_mapping, eps, T,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=num_heads, HKV=num_kv_heads, D=D, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_T=block_t,
        NORM=norm, FP8=k_cache.dtype == FP8_KV, FP8_MAX=FP8_KV_MAX, num_warps=warps)
    return q
