"""Triton paged-decode attention: one query token per sequence, K/V read in place
through the block table (no gather; ENGINE.md §3.1 measured gathering 11x slower).

Grid: (sequence, kv head). A program loads the GQA group's ``GROUP`` query heads
(padded to 16 rows so ``tl.dot`` applies), walks the sequence's context in tiles of
``BLOCK_N`` tokens (each token's block looked up in the table, so any block size works) and keeps
an online softmax (running max ``m``, normaliser ``l``, accumulator ``acc``) in fp32.
The loop bound is read from ``context_lens`` on the device, so the launch is
CUDA-graph-capturable with any per-sequence lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(Q, K, V, O, BT, CL, scale,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                         stride_ot, stride_oh,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(CL + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, ctx, BLOCK_N):
        tok = start + n
        kmask = tok < ctx
        # per-token block lookup: a tile may span several small blocks
        blk = tl.load(BT + b * stride_bt + tok // PAGE, mask=kmask, other=0).to(tl.int64)
        off = (blk * stride_kb + (tok % PAGE) * stride_ks)[:, None] + kvh * stride_kh + d[None, :]
        k = tl.load(K + off, mask=kmask[:, None] & dmask[None, :], other=0.0)
        if IEEE:  # fp32 caches (tests): no tf32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + off, mask=kmask[:, None] & dmask[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(O + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[B, H, D]``; caches ``[N, block_size, Hkv, D]``; block_tables ``[B, M]`` int32;
    context_lens ``[B]`` int32 (>= 1) -> out ``[B, H, D]``."""
    B, H, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    block_n = 64
    assert k_cache.stride(3) == 1 and q.stride(2) == 1
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)), PAGE=page, BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32, num_warps=4)
    return out
