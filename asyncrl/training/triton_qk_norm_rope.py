"""Triton kernels for the trainer's per-row norms: Qwen3's q/k RMSNorm fused with RoPE, and the
hidden-state RMSNorm, forward and exact backward.

Why (issue 20): at the peer shape (T = 36,736 packed tokens, Qwen3-0.6B) Liger's RMSNorm backward
took 490 us per q_norm call and 268 us per hidden norm (bandwidth bound: ~55 us), and HF's module
moves q/k between [1, T, H, D] and its transposed [1, H, T, D] view around Liger's RoPE, the
attention and their backwards (21.6 ms of ``aten::copy_`` per update). Here q/k stay [T, H, D]
(the projection's output viewed per head) and one kernel does, per row (one token's head):

    n = bf(x * rsqrt(mean(x^2) + eps))        rounded to x's dtype, as HF's Qwen3RMSNorm
    a = bf(w * n)                             rounded to x's dtype, as HF's ``weight * n``
    y = a * c + rotate_half(a) * s            c, s = bf(cos / sin(pos * inv_freq)), as HF's rotary
                                              embedding; one rounding of y (HF rounds each product)

with ``rotate_half(a) = [-a2, a1]`` (a1, a2: the two halves of the head dim). Without RoPE the
same kernel is the hidden norm (``y = a``). Backward (the casts' gradients are the identity, as in
autograd):

    da = [dy1 c + dy2 s, dy2 c - dy1 s]        (RoPE's transpose; da = dy without RoPE)
    dw = sum over rows of da * n               (per-program fp32 partial sums, then one sum)
    dx = r * (da w) - x * r^3 * sum(da w x) / D      (r = rsqrt(mean(x^2) + eps), fp32)

r is recomputed from x in backward (x is saved anyway): nothing else is stored. x is seen as
[n_tok, heads, D] ([T, H, D] for q/k; [rows, 1, D] for the hidden norm); a program step takes all
heads of BLOCK_T tokens (a [BLOCK_T, BLOCK_H, D/2] tile per half, ~TILE elements), so cos / sin
are computed once per token, not once per head. Backward programs run
ITERS steps each, so a program's dw partial covers ITERS * BLOCK_T tokens. Tests:
tests/training/test_triton_qk_norm_rope.py (float64 references, ``TRITON_INTERPRET=1`` on the CPU).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

TILE = 4096  # elements of x per program step (tokens x heads x D): 32 per thread at 4 warps
NUM_WARPS = 4
TARGET_PROGRAMS = 1024  # backward: enough programs for 132 SMs; more tokens each keep the dw partials small
MAX_ITERS = 16
# tl.cos / tl.sin compile to the GPU's approximate cos.approx / sin.approx, whose error grows with
# the argument (angles reach ~1e4 rad at long positions): ~1e-4 off torch's fp32 cos, which the
# float64 tests caught on an H200. libdevice's __nv_cosf / __nv_sinf do full range reduction, as
# torch does. The Triton interpreter (CPU tests) has no libdevice; its tl.cos is numpy's, exact.
PRECISE_TRIG = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _tile(tok0, n_tok, heads, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
          HALF: tl.constexpr):
    """Offsets [BLOCK_T, BLOCK_H, BLOCK_HALF] of the first halves of tokens tok0.. (x [n_tok, heads,
    2 * HALF] contiguous), their mask, the tokens [BLOCK_T] and the token mask."""
    toks = tok0 + tl.arange(0, BLOCK_T)
    hs = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    tok_ok = toks < n_tok
    mask = tok_ok[:, None, None] & (hs < heads)[None, :, None] & (cols < HALF)[None, None, :]
    offs = (toks[:, None, None] * heads + hs[None, :, None]) * (2 * HALF) + cols[None, None, :]
    return offs, mask, toks, tok_ok


@triton.jit
def _load_halves(ptr, offs, mask, HALF: tl.constexpr):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), \
        tl.load(ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _weight_halves(w_ptr, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr):
    """w's halves as [1, 1, BLOCK_HALF] fp32."""
    cols = tl.arange(0, BLOCK_HALF)
    w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    return w1[None, None, :], w2[None, None, :]


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, toks, tok_ok, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr, dtype,
             PRECISE: tl.constexpr):
    """HF's rotary embedding of the tokens, once per token (shared by its heads): fp32 angle
    pos * inv_freq, cos / sin rounded to the activations' dtype (HF returns them in x's dtype),
    as [BLOCK_T, 1, BLOCK_HALF] fp32."""
    cols = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + toks, mask=tok_ok, other=0).to(tl.float32)
    inv = tl.load(inv_freq_ptr + cols, mask=cols < HALF, other=0.0)
    angle = pos[:, None] * inv[None, :]
    if PRECISE:
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:
        c, s = tl.cos(angle), tl.sin(angle)
    c = c.to(dtype).to(tl.float32)
    s = s.to(dtype).to(tl.float32)
    return c[:, None, :], s[:, None, :]


@triton.jit
def _rstd(x1, x2, eps, HALF: tl.constexpr):
    """[BLOCK_T, BLOCK_H, 1] fp32 inverse RMS of each row (token, head)."""
    return tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF) + eps)[:, :, None]


@triton.jit
def _forward_kernel(x_ptr, y_ptr, w_ptr, pos_ptr, inv_freq_ptr, n_tok, heads, eps, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, ROPE: tl.constexpr,
                    PRECISE_TRIG: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    offs, mask, toks, tok_ok = _tile(tl.program_id(0).to(tl.int64) * BLOCK_T, n_tok, heads, BLOCK_T, BLOCK_H,
                                     BLOCK_HALF, HALF)
    x1, x2 = _load_halves(x_ptr, offs, mask, HALF)
    rstd = _rstd(x1, x2, eps, HALF)
    w1, w2 = _weight_halves(w_ptr, BLOCK_HALF, HALF)
    a1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    a2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if ROPE:
        c, s = _cos_sin(pos_ptr, inv_freq_ptr, toks, tok_ok, BLOCK_HALF, HALF, dtype, PRECISE_TRIG)
        a1, a2 = a1 * c - a2 * s, a2 * c + a1 * s
    tl.store(y_ptr + offs, a1.to(dtype), mask=mask)
    tl.store(y_ptr + offs + HALF, a2.to(dtype), mask=mask)


@triton.jit
def _backward_kernel(x_ptr, dy_ptr, dx_ptr, w_ptr, dw_partial_ptr, pos_ptr, inv_freq_ptr, n_tok, heads, eps,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                     ITERS: tl.constexpr, ROPE: tl.constexpr, PRECISE_TRIG: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    w1, w2 = _weight_halves(w_ptr, BLOCK_HALF, HALF)
    dw1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    for i in range(ITERS):
        offs, mask, toks, tok_ok = _tile((pid * ITERS + i) * BLOCK_T, n_tok, heads, BLOCK_T, BLOCK_H, BLOCK_HALF,
                                         HALF)
        x1, x2 = _load_halves(x_ptr, offs, mask, HALF)
        g1, g2 = _load_halves(dy_ptr, offs, mask, HALF)
        rstd = _rstd(x1, x2, eps, HALF)
        if ROPE:
            c, s = _cos_sin(pos_ptr, inv_freq_ptr, toks, tok_ok, BLOCK_HALF, HALF, dtype, PRECISE_TRIG)
            g1, g2 = g1 * c + g2 * s, g2 * c - g1 * s
        # dw: the rounded n, as autograd of HF's ``weight * n`` sees it (masked rows: x = 0, n = 0)
        dw1 += tl.sum(tl.sum(g1 * (x1 * rstd).to(dtype).to(tl.float32), axis=1), axis=0)
        dw2 += tl.sum(tl.sum(g2 * (x2 * rstd).to(dtype).to(tl.float32), axis=1), axis=0)
        g1, g2 = g1 * w1, g2 * w2
        k = rstd * rstd * rstd * (tl.sum(g1 * x1, axis=2) + tl.sum(g2 * x2, axis=2))[:, :, None] / (2 * HALF)
        tl.store(dx_ptr + offs, (rstd * g1 - x1 * k).to(dtype), mask=mask)
        tl.store(dx_ptr + offs + HALF, (rstd * g2 - x2 * k).to(dtype), mask=mask)
    cols = tl.arange(0, BLOCK_HALF)
    out = dw_partial_ptr + pid * (2 * HALF) + cols
    tl.store(out, dw1, mask=cols < HALF)
    tl.store(out + HALF, dw2, mask=cols < HALF)


def _geometry(heads: int, dim: int) -> dict:
    """Block sizes for tokens of ``heads`` rows of ``dim`` elements: all heads of BLOCK_T tokens
    per step (~TILE elements)."""
    half = dim // 2
    block_half, block_h = triton.next_power_of_2(half), triton.next_power_of_2(heads)
    return dict(HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h,
                BLOCK_T=max(1, TILE // (2 * block_half * block_h)))


class _NormRope(torch.autograd.Function):
    """y = rope(w * rmsnorm(x)) per row of x [n_tok, heads, D] (contiguous); rope off when
    ``positions`` is None."""

    @staticmethod
    def forward(ctx, x, weight, positions, inv_freq, eps):
        n_tok, heads, dim = x.shape
        y = torch.empty_like(x)
        geo = _geometry(heads, dim)
        rope = positions is not None
        _forward_kernel[(triton.cdiv(n_tok, geo["BLOCK_T"]),)](
            x, y, weight, positions if rope else x, inv_freq if rope else x, n_tok, heads, eps, ROPE=rope,
            PRECISE_TRIG=PRECISE_TRIG, num_warps=NUM_WARPS, **geo)
        ctx.save_for_backward(x, weight, *((positions, inv_freq) if rope else ()))
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, *rope_args = ctx.saved_tensors
        n_tok, heads, dim = x.shape
        geo = _geometry(heads, dim)
        blocks = triton.cdiv(n_tok, geo["BLOCK_T"])
        iters = max(1, min(MAX_ITERS, blocks // TARGET_PROGRAMS))
        programs = triton.cdiv(blocks, iters)
        dx = torch.empty_like(x)
        partial = torch.empty(programs, dim, dtype=torch.float32, device=x.device)
        positions, inv_freq = rope_args if rope_args else (x, x)
        _backward_kernel[(programs,)](
            x, dy.contiguous(), dx, weight, partial, positions, inv_freq, n_tok, heads, ctx.eps, ITERS=iters,
            ROPE=bool(rope_args), PRECISE_TRIG=PRECISE_TRIG, num_warps=NUM_WARPS, **geo)
        dw = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                 inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (q or k per head, any strides: made contiguous), weight [D] (x's dtype),
    positions [T] long, inv_freq [D / 2] float32 -> rope(rmsnorm(x) * weight) [T, H, D]."""
    assert x.dim() == 3 and positions.shape == (x.shape[0],) and inv_freq.shape == (x.shape[2] // 2,)
    if not x.device == weight.device == positions.device == inv_freq.device:
        raise ValueError(f"qk_norm_rope: x, weight, positions and inv_freq must share a device, got {x.device}, "
                         f"{weight.device}, {positions.device}, {inv_freq.device}")
    return _NormRope.apply(x.contiguous(), weight, positions.contiguous(), inv_freq.float().contiguous(), float(eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (D even), weight [D] (x's dtype) -> HF's Qwen3/Llama RMSNorm of x, same shape."""
    rows = x.contiguous().view(-1, 1, x.shape[-1])
    return _NormRope.apply(rows, weight, None, None, float(eps)).view(x.shape)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernels cannot take ``x`` with ``weight`` (None: they can)."""
    if x.shape[-1] % 2 or weight.shape != (x.shape[-1],):
        return f"row size {x.shape[-1]} with weight {tuple(weight.shape)} (an even D and a [D] weight are needed)"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} != activations' {x.dtype} (HF would promote the output)"
    return None
