"""Triton paged-decode attention: one query token per sequence, K/V read in place
through the block table (no gather; ENGINE.md §3.1 measured gathering 11x slower).

Grid: (sequence, kv head). A program loads the GQA group's ``GROUP`` query heads
(padded to 16 rows so ``tl.dot`` applies), walks the sequence's context in tiles of
``BLOCK_N`` tokens (each token's block looked up in the table, so any block size works) and keeps
an online softmax (running max ``m``, normaliser ``l``, accumulator ``acc``) in fp32.
The loop bound is read from ``context_lens`` on the device, so the launch is
CUDA-graph-capturable with any per-sequence lengths. K/V tiles are converted to the query's dtype
as they are loaded (a no-op for a bf16 cache; an FP8 cache, ``kv_cache_dtype="fp8"``, is read at
half the bytes and upcast exactly).

Cascade (shared-prefix) decode, see ``cascade.py``: ``_prefix_kernel`` attends each
prefix tile (the members x GQA query rows of one group, one kv head) to the group's
shared blocks once, in the step's number of chunks (``cascade.CascadeLaunchRule``: more
chunks when few groups leave SMs idle; read from the plan on the device) by a persistent grid,
and writes per-row (out, lse) of each chunk; the decode kernel with ``CASCADE`` then walks only
``[suffix_start, ctx)`` (optionally split-KV) and merges the prefix chunks into its online
softmax state before normalising (no merge kernel unless the suffix is split). With
``CascadeLaunchRule.concurrent_prefix`` the two run on two streams instead (``concurrent_cascade``):
the suffix kernel without ``PREFIX_MERGE`` writes partials and ``_merge_cascade_kernel`` merges them.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from asyncrl.engine import cascade as cascade_module
from asyncrl.engine.cascade import CascadeLaunchRule
from asyncrl.engine.pdl import launch_options, wait_then_release


@triton.jit
def _merge_part(m, l, acc, lse_p, o_p):
    """Folds a normalised part (out ``o_p`` [R, D], log-sum-exp ``lse_p`` [R]) into an online-softmax
    state (running max ``m``, normaliser ``l`` [R], accumulator ``acc`` [R, D]); returns the new state."""
    m_new = tl.maximum(m, lse_p)
    alpha = tl.exp(m - m_new)
    beta = tl.exp(lse_p - m_new)
    return m_new, l * alpha + beta, acc * alpha[:, None] + o_p * beta[:, None]


# ``LAZY_RESCALE``: the running max m moves only when a row's tile max exceeds it by more than this (natural
# log units, FlashAttention-4's conditional rescale): p = exp(s - m) <= e^8 ~ 2,981 then, inside fp16 and bf16,
# and most tiles skip the accumulator's rescale (BLOCK_D / 4 multiplies a thread at one warp). Exact: p, l
# and acc always share one m.
RESCALE_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def _tile_block(row, start, bt_idx, bt_row, PAGE: tl.constexpr, BT_REGS: tl.constexpr):
    """The block id (int64) of the tile at key ``start`` (a tile within one block): from the block-table row
    in registers (``bt_row`` at ``bt_idx``, BT_REGS > 0: no load on the K/V address chain, so the pipeline can
    run ``num_stages - 1`` ahead) or loaded from the row at ``row``."""
    if BT_REGS > 0:
        blk = tl.sum(tl.where(bt_idx == start // PAGE, bt_row, 0), 0).to(tl.int64)
    else:
        blk = tl.load(row + start // PAGE).to(tl.int64)
    return blk


@triton.jit
def _next_tile_block(row, start, last, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``BT_PREFETCH``: the block id (int64) of the tile after the one at ``start``, loaded an iteration ahead
    (0 past ``last``)."""
    return tl.load(row + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < last, other=0).to(tl.int64)


@triton.jit
def _attend_tile(q, m, l, acc, kp, vp, lmask, tok, kmask, limit, scale,
                 cdt: tl.constexpr, MASKED: tl.constexpr, QLEN: tl.constexpr, IEEE: tl.constexpr,
                 LAZY_RESCALE: tl.constexpr):
    """One K/V tile into the online softmax state (m, l [R], acc [R, D] fp32): q [R, D] in ``cdt``,
    K / V pointers ``kp`` / ``vp`` [BLOCK_N, BLOCK_D], ``tok`` [BLOCK_N] the tile's key positions,
    ``limit`` [R] the last key each row sees (QLEN > 1). MASKED: the loads take ``lmask`` and keys with
    ``kmask`` false weigh 0; unmasked tiles (every key valid, every column in D) skip both."""
    if MASKED:
        k = tl.load(kp, mask=lmask, other=0.0).to(cdt)
    else:
        k = tl.load(kp).to(cdt)
    if IEEE:  # fp32 caches (tests): no tf32 rounding
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale  # [R, BLOCK_N]
    if QLEN > 1:  # causal among the step's own tokens; a row may see no key of a tile
        seen = tok[None, :] <= limit[:, None]
        if MASKED:
            seen = seen & kmask[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        l = l * alpha
        acc = acc * alpha[:, None]
    else:
        if MASKED:
            s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every row sees a key of its first tile
        if LAZY_RESCALE:
            if tl.max(m_new - m, 0) > RESCALE_THRESHOLD:
                alpha = tl.exp(m - m_new)
                l = l * alpha
                acc = acc * alpha[:, None]
                m = m_new
            m_new = m
        else:
            alpha = tl.exp(m - m_new)
            l = l * alpha
            acc = acc * alpha[:, None]
        m_ref = m_new
    p = tl.exp(s - m_ref[:, None])
    l = l + tl.sum(p, 1)
    if MASKED:
        v = tl.load(vp, mask=lmask, other=0.0).to(cdt)
    else:
        v = tl.load(vp).to(cdt)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l, acc


@triton.jit
def _paged_decode_kernel(Q, K, V, O, BT, CL, START, NSP, PO, PL, SO, SL, ORDER, scale, max_parts,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                         stride_ot, stride_oh, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr, CASCADE: tl.constexpr,
                         KV_SPLITS: tl.constexpr, QLEN: tl.constexpr, BT_REGS: tl.constexpr,
                         EARLY_PREFIX: tl.constexpr = False, PREFIX_MERGE: tl.constexpr = True,
                         F16_DOTS: tl.constexpr = False, BT_PREFETCH: tl.constexpr = False,
                         ORDERED: tl.constexpr = False, TILED: tl.constexpr = False,
                         LAZY_RESCALE: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program (sequence b, kv head, KV chunk); ORDERED (``DecodeLaunch.longest_first``): program
    (kv head, rank, KV chunk) takes sequence ``b = ORDER[rank]``, so the grid dispatches the longest
    sequences' programs (all their kv heads) first. Its rows are the ``QLEN`` query tokens x the
    ``GROUP`` q heads of this kv head (row r: token ``b * QLEN + r // GROUP``, head
    ``kvh * GROUP + r % GROUP``); query i of a sequence sees keys ``[0, ctx - QLEN + i]``
    (QLEN > 1: a speculative verify step, the last token and its drafts).
    CASCADE: keys ``[0, START[b])`` come from the prefix kernel as ``NSP[0]`` (clamped to
    ``[1, max_parts]``) parts in PO / PL, merged into the state of KV chunk 0. EARLY_PREFIX (opt-in):
    part 0 is loaded before the suffix loop and starts the online softmax (its load latency
    overlaps the suffix's loads instead of following them); the other parts merge after.
    CASCADE without PREFIX_MERGE (``CascadeLaunchRule.concurrent_prefix``): the prefix partials are
    not read (the prefix kernel may still be running on another stream); keys ``[START[b], ctx)``
    only, written as partial (out, lse) to SO / SL like split-KV chunks, for
    ``_merge_cascade_kernel``. F16_DOTS (``f16_dots``): q, K, V and p enter the dots as fp16.
    TILED (``tiled_loads``: ``PAGE % BLOCK_N == 0`` and ``D == BLOCK_D``): a tile lies in one block, so its
    addresses are the block's base plus loop-invariant offsets, and every tile but the last loads without
    masks. LAZY_RESCALE (``RESCALE_THRESHOLD``; one query token): the running max moves only when it must.
    USE_PDL (``engine/pdl.py``): launched with programmatic dependent launch; it waits for the kernel before (the
    K/V write) first, then lets the next one (the o GEMM, which prefetches its weights) launch into its tail."""
    wait_then_release(USE_PDL)
    if ORDERED:
        b = tl.load(ORDER + tl.program_id(1))
        kvh = tl.program_id(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    ctx = tl.load(CL + b)
    sfx = 0
    if CASCADE:
        sfx = tl.load(START + b)  # tokens [0, sfx) come from the prefix kernel
    first = sfx
    last = ctx
    sid = 0
    if KV_SPLITS > 1:  # split-KV (flash-decoding): this program takes one chunk of [sfx, ctx)
        sid = tl.program_id(2)
        span = tl.cdiv(tl.cdiv(ctx - sfx, KV_SPLITS), BLOCK_N) * BLOCK_N  # BLOCK_N-aligned: sfx is a block start
        first = sfx + sid * span
        last = tl.minimum(first + span, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gmask = g < GROUP * QLEN
    dmask = d < D
    qi = g // GROUP  # the row's query token within the sequence (0 unless QLEN > 1)
    heads = kvh * GROUP + g % GROUP
    qtok = b * QLEN + qi  # the row's packed token index
    q = tl.load(Q + qtok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    cdt: tl.constexpr = tl.float16 if F16_DOTS else Q.dtype.element_ty
    q = q.to(cdt)
    limit = ctx - QLEN + qi  # the last key position each row sees
    row = BT + b * stride_bt  # the sequence's block-table row
    bt_idx = 0  # read only under BT_REGS
    bt_row = 0
    if BT_REGS > 0:  # opt-in (table_regs): the row's block table in registers, read once
        bt_idx = tl.arange(0, BT_REGS)
        bt_row = tl.load(row + bt_idx, mask=bt_idx < tl.cdiv(last, PAGE), other=0)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    merged = 0  # prefix parts already in (m, l, acc)
    if CASCADE and EARLY_PREFIX and PREFIX_MERGE:
        # part 0 = (out o0, lse0) of the prefix's first chunk, never empty: the state (m, l, acc) =
        # (lse0, 1, o0) stands for exactly its keys. Rows outside a group (sfx == 0) or in another KV
        # chunk keep the empty state; their loaded values (never written for them) are discarded.
        own = gmask & (sfx > 0)
        if KV_SPLITS > 1:
            own = own & (sid == 0)
        lse0 = tl.load(PL + b * stride_plt + heads, mask=gmask, other=0.0)
        o0 = tl.load(PO + b * stride_pot + heads[:, None] * stride_poh + d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        m = tl.where(own, lse0, float("-inf"))
        l = tl.where(own, 1.0, 0.0)
        acc = tl.where(own[:, None], o0, 0.0)
        merged = 1
    if BT_PREFETCH:  # the first tile's block; each iteration loads the next one's (PAGE % BLOCK_N == 0)
        nxt = tl.load(row + first // PAGE, mask=first < last, other=0).to(tl.int64)
    if TILED:  # block base + invariant offsets; full tiles unmasked, then the partial one (if any) masked
        inner = (n * stride_ks)[:, None] + d[None, :]
        kh = K + kvh * stride_kh
        vh = V + kvh * stride_kh
        full = first + (last - first) // BLOCK_N * BLOCK_N
        for start in range(first, full, BLOCK_N):
            if BT_PREFETCH:  # this tile's block was loaded an iteration ago: off the K/V address chain
                blk = nxt
                nxt = _next_tile_block(row, start, last, PAGE, BLOCK_N)
            else:
                blk = _tile_block(row, start, bt_idx, bt_row, PAGE, BT_REGS)
            base = blk * stride_kb + (start % PAGE) * stride_ks
            m, l, acc = _attend_tile(q, m, l, acc, kh + base + inner, vh + base + inner, None, start + n, None,
                                     limit, scale, cdt, False, QLEN, IEEE, LAZY_RESCALE)
        if full < last:
            if BT_PREFETCH:
                blk = nxt
            else:
                blk = _tile_block(row, full, bt_idx, bt_row, PAGE, BT_REGS)
            base = blk * stride_kb + (full % PAGE) * stride_ks
            tok = full + n
            kmask = tok < last
            m, l, acc = _attend_tile(q, m, l, acc, kh + base + inner, vh + base + inner, kmask[:, None], tok,
                                     kmask, limit, scale, cdt, True, QLEN, IEEE, LAZY_RESCALE)
    else:
        for start in range(first, last, BLOCK_N):
            tok = start + n
            kmask = tok < last
            if BT_PREFETCH:  # this tile's block was loaded an iteration ago: off the K/V address chain
                blk = nxt
                nxt = _next_tile_block(row, start, last, PAGE, BLOCK_N)
            elif BT_REGS > 0 or PAGE % BLOCK_N == 0:  # the tile lies in one block: one lookup per tile
                blk = _tile_block(row, start, bt_idx, bt_row, PAGE, BT_REGS)
            else:  # per-token block lookup: a tile may span several small blocks
                blk = tl.load(row + tok // PAGE, mask=kmask, other=0).to(tl.int64)
            off = (blk * stride_kb + (tok % PAGE) * stride_ks)[:, None] + kvh * stride_kh + d[None, :]
            m, l, acc = _attend_tile(q, m, l, acc, K + off, V + off, kmask[:, None] & dmask[None, :], tok, kmask,
                                     limit, scale, cdt, True, QLEN, IEEE, LAZY_RESCALE)
    if CASCADE and PREFIX_MERGE:
        # merge the shared prefix's parts (out o_p, log-sum-exp lse_p) by LSE; rows outside
        # any group (sfx == 0) read lse_p = -inf, which weighs 0. Only KV chunk 0 merges: its
        # m is finite (the suffix's first chunk holds at least the current token).
        pmask = gmask & (sfx > 0)
        nsp = 1
        if max_parts > 1:  # one part (specialised when 1): no load
            nsp = tl.minimum(tl.maximum(tl.load(NSP), 1), max_parts)
        if KV_SPLITS > 1:
            nsp = tl.where(sid == 0, nsp, 0)  # other chunks may be empty (m = -inf): no merge there
        for sp in range(merged, nsp):
            lse_p = tl.load(PL + sp * stride_pls + b * stride_plt + heads, mask=pmask, other=float("-inf"))
            o_p = tl.load(PO + sp * stride_pos + b * stride_pot + heads[:, None] * stride_poh + d[None, :],
                          mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            m, l, acc = _merge_part(m, l, acc, lse_p, o_p)
    if KV_SPLITS > 1 or (CASCADE and not PREFIX_MERGE):
        # partial (out, lse) of this chunk; an empty chunk writes lse = -inf
        lsafe = tl.where(l > 0, l, 1.0)
        rows = (sid * stride_pos + qtok * stride_pot + heads * stride_poh)
        tl.store(SO + rows[:, None] + d[None, :], acc / lsafe[:, None], mask=gmask[:, None] & dmask[None, :])
        tl.store(SL + sid * stride_pls + qtok * stride_plt + heads, m + tl.log(lsafe), mask=gmask)
    else:
        out = acc / l[:, None]
        tl.store(O + qtok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _merge_splits_kernel(SO, SL, O, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                         stride_ot, stride_oh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         KV_SPLITS: tl.constexpr):
    """Grid (B, H): out = sum_s exp(lse_s - lse) * out_s over the KV_SPLITS partials (fp32)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    s = tl.arange(0, KV_SPLITS)
    lse = tl.load(SL + s * stride_pls + b * stride_plt + h)
    m = tl.max(lse, 0)  # finite: chunk 0 holds at least one token
    w = tl.exp(lse - m)
    o = tl.load(SO + s[:, None] * stride_pos + b * stride_pot + h * stride_poh + d[None, :],
                mask=dmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty), mask=dmask)


@triton.jit
def _merge_cascade_kernel(PO, PL, SO, SL, START, NSP, O, max_parts, H,
                          stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                          stride_sos, stride_sot, stride_soh, stride_sls, stride_slt,
                          stride_ot, stride_oh, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                          KV_SPLITS: tl.constexpr):
    """Grid (B, cdiv(H, BLOCK_H)): the concurrent cascade's merge (``CascadeLaunchRule.concurrent_prefix``).
    out[b, h] = LSE-merge of the suffix's ``KV_SPLITS`` partials SO / SL (fp32; chunk 0 holds the
    current token, so it starts a finite state) and, when ``START[b] > 0``, the row's prefix parts
    PO / PL (``NSP[0]`` clamped to ``[1, max_parts]``, as the suffix kernel reads them), in the
    order the serialized suffix kernel merges them, written in O's dtype."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    mask = hmask[:, None] & (d < D)[None, :]
    m = tl.load(SL + b * stride_slt + h, mask=hmask, other=0.0)
    l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.load(SO + b * stride_sot + h[:, None] * stride_soh + d[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, KV_SPLITS):  # the suffix's other chunks; an empty one has lse = -inf
        lse_s = tl.load(SL + s * stride_sls + b * stride_slt + h, mask=hmask, other=float("-inf"))
        o_s = tl.load(SO + s * stride_sos + b * stride_sot + h[:, None] * stride_soh + d[None, :], mask=mask,
                      other=0.0)
        m, l, acc = _merge_part(m, l, acc, lse_s, o_s)
    nsp = 1
    if max_parts > 1:  # one part (specialised when 1): no load
        nsp = tl.minimum(tl.maximum(tl.load(NSP), 1), max_parts)
    nsp = tl.where(tl.load(START + b) > 0, nsp, 0)  # rows outside a group: no prefix part was written
    for sp in range(0, nsp):
        lse_p = tl.load(PL + sp * stride_pls + b * stride_plt + h, mask=hmask, other=float("-inf"))
        o_p = tl.load(PO + sp * stride_pos + b * stride_pot + h[:, None] * stride_poh + d[None, :], mask=mask,
                      other=0.0).to(tl.float32)
        m, l, acc = _merge_part(m, l, acc, lse_p, o_p)
    tl.store(O + b * stride_ot + h[:, None] * stride_oh + d[None, :], (acc / l[:, None]).to(O.dtype.element_ty),
             mask=mask)


@triton.jit
def _prefix_kernel(Q, K, V, PO, PL, BT, TILES, scale, max_parts,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_tile,
                   stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                   GROUP: tl.constexpr, MPT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HKV: tl.constexpr,
                   IEEE: tl.constexpr, F16_DOTS: tl.constexpr = False, BT_PREFETCH: tl.constexpr = False):
    """Persistent: program p takes work items p, p + P, ... of ``num_tiles x HKV x nsp``
    (``num_tiles`` = TILES[0, 0], ``nsp`` = TILES[0, 1] clamped to ``[1, max_parts]``: the step's
    chunk count, read on the device so a CUDA graph replays any; tile t is row t + 1). An item =
    one tile, one kv head, one of nsp chunks of the prefix: rows r = member * GROUP +
    head-in-group, keys = the chunk of the leader's first ``plen`` tokens. Writes that chunk's
    (out, lse) per row to split ``sp`` of PO / PL (an empty chunk writes lse = -inf). F16_DOTS and
    BT_PREFETCH (``PAGE % BLOCK_N == 0``: a tile lies in one block, chunks start on a tile): as the
    decode kernel's."""
    cdt: tl.constexpr = tl.float16 if F16_DOTS else Q.dtype.element_ty
    nsp = 1
    if max_parts > 1:  # one part (specialised when 1): no load
        nsp = tl.minimum(tl.maximum(tl.load(TILES + 1), 1), max_parts)
    total = tl.load(TILES) * (HKV * nsp)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    mi = r // GROUP
    dmask = d < D
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        sp = w % nsp
        kvh = (w // nsp) % HKV
        row = TILES + (w // (nsp * HKV) + 1) * stride_tile
        leader = tl.load(row)
        plen = tl.load(row + 1)
        chunk = tl.cdiv(tl.cdiv(plen, nsp), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, plen)
        seq = tl.load(row + 2 + mi, mask=mi < MPT, other=-1)
        valid = seq >= 0
        heads = kvh * GROUP + r % GROUP
        rowq = seq.to(tl.int64) * stride_qt + heads * stride_qh
        q = tl.load(Q + rowq[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0).to(cdt)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if BT_PREFETCH:  # the first tile's block; each iteration loads the next one's
            nxt = tl.load(BT + leader * stride_bt + lo // PAGE, mask=lo < hi, other=0).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            tok = start + n
            kmask = tok < hi
            if BT_PREFETCH:  # loaded an iteration ago: no load of this iteration on the K/V address chain
                blk = nxt
                nxt = tl.load(BT + leader * stride_bt + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < hi,
                              other=0).to(tl.int64)
            else:
                blk = tl.load(BT + leader * stride_bt + tok // PAGE, mask=kmask, other=0).to(tl.int64)
            off = (blk * stride_kb + (tok % PAGE) * stride_ks)[:, None] + kvh * stride_kh + d[None, :]
            k = tl.load(K + off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(cdt)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N]
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(cdt)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        lsafe = tl.where(l > 0, l, 1.0)  # empty chunk: out 0, lse = -inf + 0
        out = acc / lsafe[:, None]
        seq64 = seq.to(tl.int64)
        rowo = sp * stride_pos + seq64 * stride_pot + heads * stride_poh
        tl.store(PO + rowo[:, None] + d[None, :], out.to(PO.dtype.element_ty), mask=valid[:, None] & dmask[None, :])
        tl.store(PL + sp * stride_pls + seq64 * stride_plt + heads, m + tl.log(lsafe), mask=valid)


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch shape of the paged-decode kernel. ``kv_splits`` 0 = choose per batch size
    (``kv_splits_for``): split each sequence's context over several programs when the
    (sequence, kv head) grid alone leaves SMs idle (small batches, long contexts)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    kv_splits: int = 0
    max_kv_splits: int = 16
    programs_per_sm: int = 4
    # Opt-in variants (issue 23, GPU numbers pending; bench/paged_decode_variants.py measures them):
    # "packed" = several kv heads per program (triton_decode_packed.py), one query token per sequence
    # only (speculative verify steps keep "base"). block_n / num_warps / num_stages apply to it too.
    variant: str = "base"
    heads_per_program: int = 0   # packed: kv heads per program, 0 = auto (D 128, group 2 -> 4)
    persistent_per_sm: int = 0   # packed: >0 = persistent grid of SMs x this, looping over work items
    fp8_block_n: int = 0         # packed: tile for an e4m3 cache (0 = block_n); 2x block_n = same bytes
    table_in_registers: bool = False  # base and packed: block-table row read once (``table_regs``)
    fp8_f16_dots: bool = True    # base: an e4m3 cache's dots in fp16 (``f16_dots``)
    table_prefetch: bool = False  # base: each tile's block id loaded one tile ahead (``bt_prefetch``)
    longest_first: bool = False  # base, plain decode: programs dispatched longest sequence first (``ORDERED``)
    max_registers: int = 0       # base: > 0 caps registers a thread (ptxas ``.maxnreg``, Triton's ``maxnreg``)
    # base, on in ``default_launch``'s launches: a tile's K/V addresses = block base + fixed offsets, masks on the
    # last tile only (``tiled``); with one query token, the accumulator rescaled only when the max moves > e^8
    tiled_loads: bool = False
    lazy_rescale: bool = False


# The packed variant's launch when ``ASYNCRL_DECODE_VARIANT=packed`` is set without a launch shape:
# 16-token tiles of 4 kv heads (16 KiB of bf16 K per tile), 8 warps, 3 stages with the block-table
# row in registers (2 tiles ahead): 104 registers a thread (bf16; 160 e4m3) and 96 KiB (48) of shared
# memory on sm90, two bf16 programs per SM (bench/paged_decode_variants.py --offline). Picked by
# those resources, not timed yet: that script times it against the alternatives per regime.
PACKED_LAUNCH = DecodeLaunch(block_n=16, num_warps=8, num_stages=3, variant="packed", fp8_block_n=16,
                             table_in_registers=True)


def _launch_from_env() -> DecodeLaunch:
    """``ASYNCRL_DECODE_LAUNCH="block_n,num_warps,num_stages[,kv_splits]"`` overrides the
    default (bench/paged_decode_sweep.py prints the best measured one in this form)."""
    raw = os.environ.get("ASYNCRL_DECODE_LAUNCH", "").strip()
    launch = DecodeLaunch(*[int(x) for x in raw.split(",")]) if raw else DecodeLaunch()
    return _variant_from_env(launch, bool(raw))


def _variant_from_env(launch: DecodeLaunch, shaped: bool) -> DecodeLaunch:
    """``ASYNCRL_DECODE_VARIANT="packed[,heads_per_program[,persistent_per_sm[,fp8_block_n[,table_in_registers]]]]"``
    switches on the packed kernel (``PACKED_LAUNCH``'s shape unless ``ASYNCRL_DECODE_LAUNCH`` set one);
    ``"base,1"`` keeps the base kernel with its block table in registers (``table_regs``)."""
    raw = os.environ.get("ASYNCRL_DECODE_VARIANT", "").strip()
    if not raw:
        return launch
    name, *nums = raw.split(",")
    names = {"base": ("table_in_registers",),
             "packed": ("heads_per_program", "persistent_per_sm", "fp8_block_n", "table_in_registers")}
    if name not in names:
        raise ValueError(f"ASYNCRL_DECODE_VARIANT={raw!r}: the variants are 'base' and 'packed'")
    base = launch if (shaped or name == "base") else PACKED_LAUNCH
    fields = dict(zip(names[name], map(int, nums)))
    if "table_in_registers" in fields:
        fields["table_in_registers"] = bool(fields["table_in_registers"])
    return dataclasses.replace(base, variant=name, **fields)


DECODE_LAUNCH = _launch_from_env()
_LAUNCH_PINNED = bool(os.environ.get("ASYNCRL_DECODE_LAUNCH", "").strip()
                      or os.environ.get("ASYNCRL_DECODE_VARIANT", "").strip())

# ``default_launch`` (one query token a sequence, no launch pinned): programs of one warp on 32-token tiles
# (``_TILED_LAUNCH``), or 16-token tiles on an e4m3 cache from ``FP8_SMALL_TILES_MIN_PROGRAMS_PER_SM`` programs
# per SM (~200 sequences at 8 kv heads on 132 SMs, ``_FP8_DENSE_LAUNCH``), each with:
# - ``longest_first``: the grid dispatches the longest sequences' programs first, so a batch of mixed contexts
#   ends on short programs instead of waiting on a long one started in the last wave (end to end, session 46:
#   workload (c) 1.03x bf16, 1.10x e4m3);
# - ``table_prefetch``: each tile's block id loaded a tile ahead, so Triton keeps 2 K/V tiles in flight;
# - ``tiled_loads`` and ``lazy_rescale``: fewer instructions a tile. Nsight Compute on the e4m3 16-token launch
#   (``bench/decode_ncu.py``, session 50) found it issue-bound (instructions issued on 58% of cycles against the
#   bf16 kernel's 29%, 744 a tile, ~40% of them integer address and mask work, 64 multiplies rescaling the
#   accumulator); both cut that to 515 a tile (25.3 M over 49,152 tiles at 256 x 384, ncu).
# Kernel bench (bench/paged_decode_variants.py, session 50, summed us, vs the rule before): e4m3 (a) 204.5 ->
# 176.2 (1.16x), (c) 202.0 -> 175.5 (1.15x), mixed contexts 1.1-1.5x; bf16 (a) 302.0 -> 293.4, (c) 274.6 -> 270.3.
# End to end (bench/decode_launch_ab.py --rules session49,default, medians of 3): e4m3 (a) 1.075x, (c) 1.050x;
# bf16 (a) 1.007x, (c) 1.013x. An earlier run of the parts: 16-token tiles on dense e4m3 grids (a) 1.10x, 32-token
# tiles everywhere (a) 1.075x and (c) 1.053x, hence 16 on dense e4m3 grids and 32 elsewhere.
# Heads wider than 128 keep the 4-warp launch: a one-warp program holds its [16, D] fp32 accumulator in 32 threads
# (D / 2 registers each), which at D 256 leaves no room for the tiles.
FP8_SMALL_TILES_MIN_PROGRAMS_PER_SM = 12
ONE_WARP_MAX_HEAD_DIM = 128
_WIDE_HEAD_LAUNCH = DecodeLaunch(table_prefetch=True, longest_first=True)
_TILED_LAUNCH = DecodeLaunch(block_n=32, num_warps=1, num_stages=3, table_prefetch=True, longest_first=True,
                             tiled_loads=True, lazy_rescale=True)
_FP8_DENSE_LAUNCH = dataclasses.replace(_TILED_LAUNCH, block_n=16)
_SUFFIX_PREFETCH_LAUNCH = DecodeLaunch(table_prefetch=True)  # the cascade's suffix kernel has no ORDERED grid


def _launch_is_default() -> bool:
    """No launch pinned by the environment, none set by a bench in ``DECODE_LAUNCH``: the per-call
    rules (``default_launch``, the cascade suffix's prefetch) may choose."""
    return not _LAUNCH_PINNED and DECODE_LAUNCH == DecodeLaunch()


def default_launch(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
    """The launch of a decode call that names none: ``DECODE_LAUNCH``, and when that is the default launch
    and one query token per sequence, ``_TILED_LAUNCH`` or on dense e4m3 grids ``_FP8_DENSE_LAUNCH``
    (``_WIDE_HEAD_LAUNCH`` for heads wider than ``ONE_WARP_MAX_HEAD_DIM``; the rules above). A launch from the
    environment, or one a bench sets in ``DECODE_LAUNCH``, is taken as is. Depends on the batch size, not the
    contexts: the same launch for every replay of a CUDA graph (the order itself comes with each step's
    inputs, ``AttentionMetadata.decode_order``)."""
    if qlen != 1 or not _launch_is_default():
        return DECODE_LAUNCH
    if k_cache.shape[3] > ONE_WARP_MAX_HEAD_DIM:
        return _WIDE_HEAD_LAUNCH
    per_sm = batch * hkv / num_sms(k_cache.device)
    if k_cache.dtype == torch.float8_e4m3fn and per_sm >= FP8_SMALL_TILES_MIN_PROGRAMS_PER_SM:
        return _FP8_DENSE_LAUNCH
    return _TILED_LAUNCH


# ``DecodeLaunch.table_in_registers``: a program loads its sequence's block-table row once (at most
# this many blocks; wider tables fall back to a lookup per tile) and picks each tile's block from
# registers. With the lookup in the loop, each K/V address depends on a load of the same iteration
# and Triton 3.6 keeps ONE K and ONE V buffer whatever num_stages says (sm90 TTGIR of the base kernel
# at 2, 3 and 4 stages: the same 38 KiB); without it, num_stages - 1 tiles are in flight (packed
# kernel: K/V buffers 2/3 at 3 stages, 3/4 at 4).
MAX_TABLE_REGS = 256


def table_regs(block_tables: torch.Tensor, page: int, block_n: int, launch: DecodeLaunch) -> int:
    """``BT_REGS`` of a launch: the table width rounded up to a power of 2 (>= 16), or 0 = a lookup
    per tile (off, a tile spanning blocks, or a table wider than ``MAX_TABLE_REGS``)."""
    if not launch.table_in_registers or page % block_n or block_tables.shape[1] > MAX_TABLE_REGS:
        return 0
    return max(16, triton.next_power_of_2(block_tables.shape[1]))


def bt_prefetch(page: int, launch: DecodeLaunch, bt_regs: int) -> bool:
    """``BT_PREFETCH`` of a launch: each iteration loads the NEXT tile's block id, so no K/V address waits
    on a load of its own iteration and Triton 3.6 pipelines the K/V copies (sm90: 2 tiles in flight at 3
    stages, 70 KiB; as the table in registers, but without its per-tile reduction over the table's width,
    which costs the gain at the engine's 33-64-block tables). Tiles within one block only; off under a
    table in registers."""
    return launch.table_prefetch and page % launch.block_n == 0 and bt_regs == 0


def tiled(page: int, block_d: int, head_dim: int, launch: DecodeLaunch) -> bool:
    """``TILED`` of a launch (``tiled_loads``): where a tile lies in one block and fills the head dim, its
    addresses are the block's base plus loop-invariant offsets and only the last tile is masked, which cuts the
    per-tile address and mask arithmetic (on sm90 ~40% of the e4m3 dense kernel's instructions were integer
    address / mask work, ``bench/decode_ncu.py``)."""
    return launch.tiled_loads and page % launch.block_n == 0 and block_d == head_dim


def cascade_prefetch(level: int, k_cache: torch.Tensor) -> bool:
    """A cascade kernel's block-id prefetch at ``level`` (``CascadeLaunchRule.suffix_prefetch`` /
    ``prefix_prefetch``): 2 = on every cache, 1 = on an e4m3 cache, 0 = off."""
    return level >= 2 or (level == 1 and k_cache.dtype == torch.float8_e4m3fn)


def prefix_prefetch(rule: CascadeLaunchRule, page: int, k_cache: torch.Tensor) -> bool:
    """``BT_PREFETCH`` of the prefix kernel (``rule.prefix_prefetch``, ``cascade_prefetch``); tiles
    within one block only (``PAGE % prefix_block_n == 0``)."""
    return cascade_prefetch(rule.prefix_prefetch, k_cache) and page % rule.prefix_block_n == 0


def f16_dots(q: torch.Tensor, k_cache: torch.Tensor, launch: DecodeLaunch | None = None) -> bool:
    """Whether the kernels run an e4m3 cache's dots in fp16 instead of the query's bf16.

    Why: on sm90 two e4m3 values become two fp16 values in one ``cvt.rn.f16x2.e4m3x2``, while bf16 needs
    that and then one ``cvt.bf16.f16`` per element (sm90 has no direct e4m3 -> bf16 conversion, and its
    conversion unit is 1/4 the FMA rate): the bf16 path spends 3x the conversions of the fp16 one per K/V
    tile; with 2 tiles in flight the fp16 dots were 1.10-1.17x the bf16 ones on an H200
    (``bench/paged_decode_variants.py``, 2026-12-04). fp16 holds every e4m3 value exactly, the softmax
    weights p in [0, 1], and a bf16 query exactly within its range (|q| < 65,504; a normalised, rotated
    query is far inside it), with 3 more mantissa bits for p than bf16."""
    launch = launch or DECODE_LAUNCH
    return launch.fp8_f16_dots and k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def kv_splits_for(batch: int, hkv: int, device: torch.device, launch: DecodeLaunch) -> int:
    """Chunks per sequence so that about ``programs_per_sm`` programs run per SM (a power of 2,
    1 when the batch alone fills the GPU). Depends on the batch size only: graph-safe."""
    if launch.kv_splits:
        return launch.kv_splits
    want = _programs(device, launch.programs_per_sm)
    splits = 1
    while splits < launch.max_kv_splits and batch * hkv * splits * 2 <= want:
        splits *= 2
    return splits


def _launch_decode(q, k_cache, v_cache, out, block_tables, context_lens, scale, cascade=None,
                   launch: DecodeLaunch | None = None, qlen: int = 1, cascade_kv_splits: int = 1,
                   early_prefix: bool = False, order: Callable[[], torch.Tensor] | None = None):
    """``cascade``: (suffix_start ``[B]``, prefix split count ``[1]``, prefix partials PO
    ``[S, B, H, D]``, PL ``[S, B, H]``) or None. ``cascade_kv_splits``: split-KV of the suffix
    under cascade (0 = ``kv_splits_for``'s per-batch rule; the base kernel only); ``early_prefix``:
    the base kernel's EARLY_PREFIX. ``order``: see ``paged_decode_attention``."""
    T, H, D = q.shape
    B = T // qlen  # sequences: each has qlen query tokens, packed
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    launch = launch or default_launch(B, hkv, k_cache, qlen)
    assert cascade is None or qlen == 1, "cascade decode takes one query token per sequence"
    if launch.variant == "packed" and qlen == 1:
        from asyncrl.engine.triton_decode_packed import launch_packed
        return launch_packed(q, k_cache, v_cache, out, block_tables, context_lens, scale, launch, cascade)
    if launch.variant not in ("base", "packed"):
        raise ValueError(f"DecodeLaunch.variant={launch.variant!r}: the variants are 'base' and 'packed'")
    if cascade is None:
        splits = kv_splits_for(B, hkv, q.device, launch)
    else:  # chunk 0 of each row's suffix merges the prefix parts
        splits = cascade_kv_splits or kv_splits_for(B, hkv, q.device, launch)
    assert splits & (splits - 1) == 0, "kv_splits must be a power of 2 (the merge kernel's tl.arange)"
    # unused pointers when not CASCADE / not split
    start, nsp, po, pl = cascade if cascade is not None else (context_lens, context_lens, out[None],
                                                              out[None, :, :, 0])
    if splits > 1:
        so = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
        sl = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
        if cascade is None:
            po, pl = so, sl  # the split buffers' strides travel in the po/pl stride slots
        else:  # both [*, T, H(, D)] contiguous: the same element strides
            assert po.is_contiguous() and pl.is_contiguous() and po.shape[1:] == so.shape[1:]
    else:
        so, sl = po, pl
    block_d = max(16, triton.next_power_of_2(D))
    bt_regs = table_regs(block_tables, page, launch.block_n, launch)
    ordered = launch.longest_first and cascade is None
    ranks = context_lens  # ORDER: read only when ordered
    if ordered:
        ranks = order() if order is not None else longest_first_order(context_lens)
    grid = (hkv, B, splits) if ordered else (B, hkv, splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, start, nsp, po, pl, so, sl, ranks, scale, po.shape[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group * qlen)), D=D,
        BLOCK_D=block_d, PAGE=page, BLOCK_N=launch.block_n,
        IEEE=q.dtype == torch.float32, CASCADE=cascade is not None,
        KV_SPLITS=splits, QLEN=qlen, BT_REGS=bt_regs, BT_PREFETCH=bt_prefetch(page, launch, bt_regs),
        EARLY_PREFIX=early_prefix and cascade is not None, F16_DOTS=f16_dots(q, k_cache, launch),
        ORDERED=ordered, TILED=tiled(page, block_d, D, launch), LAZY_RESCALE=launch.lazy_rescale and qlen == 1,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **launch_options(q.device),
        **({"maxnreg": launch.max_registers} if launch.max_registers else {}))
    if splits > 1:
        _merge_splits_kernel[(T, H)](
            so, sl, out, so.stride(0), so.stride(1), so.stride(2), sl.stride(0), sl.stride(1),
            out.stride(0), out.stride(1), D=D, BLOCK_D=block_d, KV_SPLITS=splits, num_warps=4)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           launch: DecodeLaunch | None = None, query_len: int = 1,
                           order: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """q ``[B * query_len, H, D]`` (each sequence's ``query_len`` tokens packed, in order);
    caches ``[N, block_size, Hkv, D]``; block_tables ``[B, M]`` int32; context_lens ``[B]``
    int32 (>= query_len: the keys up to and including the sequence's last query token) ->
    out like q. Query i of a sequence attends keys ``[0, context_len - query_len + i]``.
    ``launch``: default ``default_launch``'s. ``order``: under ``launch.longest_first``, a callable
    giving the sequences longest first (``longest_first_order``; called only then, so a step's layers
    share one); None = computed here."""
    assert k_cache.stride(3) == 1 and q.stride(2) == 1
    return _launch_decode(q, k_cache, v_cache, torch.empty_like(q), block_tables, context_lens, scale,
                          launch=launch, qlen=query_len, order=order)


def longest_first_order(context_lens: torch.Tensor) -> torch.Tensor:
    """``[B]`` int32: the sequences by context length, longest first (ties in batch order). One
    device sort, no host sync: graph-safe. The engine's decode steps sort on the host instead
    (``ModelRunner._decode_paged_inputs``, the same order); this serves callers without one."""
    return torch.argsort(context_lens, descending=True, stable=True).to(torch.int32)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 off CUDA: the Triton interpreter's CPU tests)."""
    if device.type != "cuda":
        return 8
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:  # read once: a decode call asks per layer
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter (CPU tests)
    return num_sms(device) * per_sm


def cascade_suffix_launch(rule: CascadeLaunchRule, base: DecodeLaunch | None = None,
                          batch_rows: int | None = None, k_cache: torch.Tensor | None = None) -> DecodeLaunch:
    """The suffix decode's launch: ``base`` with the rule's non-zero ``suffix_block_n`` /
    ``suffix_warps`` / ``suffix_stages``; where those are 0 and the batch has at most
    ``rule.small_batch_rows`` rows, the rule's small-batch tile. ``batch_rows`` is the launch's batch
    size (fixed per CUDA graph bucket, so graph-safe); None = not a small batch. ``base`` defaults to
    ``DECODE_LAUNCH``, with block ids prefetched (``table_prefetch``) where ``rule.suffix_prefetch`` asks
    for it on ``k_cache``'s dtype (``cascade_prefetch``) and no launch is pinned. Unlike the plain
    decode's rule, not on full bf16 grids: a suffix is short (the response so far), and there the
    prefetch cost bf16 2-9% at 512 rows (bench/cascade_prefetch.py, H200)."""
    if base is None:
        base = DECODE_LAUNCH
        if k_cache is not None and cascade_prefetch(rule.suffix_prefetch, k_cache) and _launch_is_default():
            base = _SUFFIX_PREFETCH_LAUNCH
    small = batch_rows is not None and batch_rows <= rule.small_batch_rows
    return dataclasses.replace(base,
                               block_n=rule.suffix_block_n or (rule.small_suffix_block_n if small else base.block_n),
                               num_warps=rule.suffix_warps or (rule.small_suffix_warps if small else base.num_warps),
                               num_stages=rule.suffix_stages or base.num_stages)


def prefix_partials(q: torch.Tensor, rule: CascadeLaunchRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty prefix partials for ``launch_prefix``: (out ``[S, B, H, D]`` in q's dtype, lse ``[S, B, H]``
    fp32), ``S = rule.max_splits``, on the current stream."""
    B, H, D = q.shape
    return (torch.empty(rule.max_splits, B, H, D, dtype=q.dtype, device=q.device),
            torch.empty(rule.max_splits, B, H, dtype=torch.float32, device=q.device))


def launch_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  tiles: torch.Tensor, scale: float, rule: CascadeLaunchRule,
                  partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix kernel alone: q ``[B, H, D]``, tiles as in ``cascade_decode_attention`` ->
    partials (out ``[S, B, H, D]`` in q's dtype, lse ``[S, B, H]`` fp32), ``S = rule.max_splits``;
    chunk ``c`` of a member row is valid for ``c <`` the header's count (rows outside tiles: never).
    ``partials``: write into these (``prefix_partials``; allocated by the caller before it forks a
    stream), else new ones."""
    B, H, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    mpt = tiles.shape[1] - 2
    block_m = max(32, triton.next_power_of_2(group))
    assert block_m // group == mpt, "tiles made for another GQA shape"
    assert k_cache.stride(3) == 1 and q.stride(2) == 1 and tiles.is_contiguous()
    splits = rule.max_splits
    po, pl = partials if partials is not None else prefix_partials(q, rule)
    assert po.shape == (splits, B, H, D) and pl.shape == (splits, B, H) and po.is_contiguous() and pl.is_contiguous()
    grid = min((tiles.shape[0] - 1) * hkv * splits, _programs(q.device, rule.prefix_programs_per_sm))
    _prefix_kernel[(max(1, grid),)](
        q, k_cache, v_cache, po, pl, block_tables, tiles, scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), tiles.stride(0), po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        GROUP=group, MPT=mpt, BLOCK_M=block_m, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PAGE=page, BLOCK_N=rule.prefix_block_n, HKV=hkv,
        IEEE=q.dtype == torch.float32, F16_DOTS=f16_dots(q, k_cache),
        BT_PREFETCH=prefix_prefetch(rule, page, k_cache), num_warps=rule.prefix_warps)
    return po, pl


def launch_suffix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, suffix_start: torch.Tensor, tiles: torch.Tensor, scale: float,
                  partials: tuple[torch.Tensor, torch.Tensor], rule: CascadeLaunchRule,
                  launch: DecodeLaunch | None = None) -> torch.Tensor:
    """The suffix decode alone, merging ``launch_prefix``'s partials: -> out like q."""
    nsp = tiles.view(-1)[1:2]  # the header's chunk count
    return _launch_decode(q, k_cache, v_cache, torch.empty_like(q), block_tables, context_lens, scale,
                          cascade=(suffix_start, nsp, *partials),
                          launch=launch or cascade_suffix_launch(rule, batch_rows=q.shape[0], k_cache=k_cache),
                          cascade_kv_splits=rule.suffix_kv_splits, early_prefix=bool(rule.suffix_early_prefix))


def launch_suffix_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, suffix_start: torch.Tensor,
                           scale: float, rule: CascadeLaunchRule,
                           launch: DecodeLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The suffix decode without the prefix (``PREFIX_MERGE=False``): each row attends its own keys
    ``[suffix_start[b], ctx)`` (all of them when ``suffix_start[b] == 0``) -> partials (out ``[KS, B, H,
    D]``, lse ``[KS, B, H]``, fp32), ``KS`` = the rule's suffix split-KV (chunk 0 never empty).
    The base kernel only (the packed variant merges the prefix inside its kernel: refused)."""
    B, H, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    launch = launch or cascade_suffix_launch(rule, batch_rows=B, k_cache=k_cache)
    if launch.variant != "base":
        raise ValueError(f"CascadeLaunchRule.concurrent_prefix takes the base suffix kernel, not the "
                         f"{launch.variant!r} variant (set concurrent_prefix=0 or ASYNCRL_DECODE_VARIANT=base)")
    assert k_cache.stride(3) == 1 and q.stride(2) == 1
    splits = rule.suffix_kv_splits or kv_splits_for(B, hkv, q.device, launch)
    assert splits & (splits - 1) == 0, "kv_splits must be a power of 2"
    so = torch.empty(splits, B, H, D, dtype=torch.float32, device=q.device)
    sl = torch.empty(splits, B, H, dtype=torch.float32, device=q.device)
    bt_regs = table_regs(block_tables, page, launch.block_n, launch)
    block_d = max(16, triton.next_power_of_2(D))
    # O, NSP, PO and PL are not read (no prefix merge, partial output): so / sl fill their slots
    _paged_decode_kernel[(B, hkv, splits)](
        q, k_cache, v_cache, so, block_tables, context_lens, suffix_start, context_lens, so, sl, so, sl, context_lens,
        scale, 1,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), so.stride(1), so.stride(2),
        so.stride(0), so.stride(1), so.stride(2), sl.stride(0), sl.stride(1),
        GROUP=H // hkv, BLOCK_G=max(16, triton.next_power_of_2(H // hkv)), D=D,
        BLOCK_D=block_d, PAGE=page, BLOCK_N=launch.block_n,
        IEEE=q.dtype == torch.float32, CASCADE=True, KV_SPLITS=splits, QLEN=1,
        BT_REGS=bt_regs, EARLY_PREFIX=False, PREFIX_MERGE=False, BT_PREFETCH=bt_prefetch(page, launch, bt_regs),
        F16_DOTS=f16_dots(q, k_cache, launch), TILED=tiled(page, block_d, D, launch),
        LAZY_RESCALE=launch.lazy_rescale, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return so, sl


def merge_cascade(prefix: tuple[torch.Tensor, torch.Tensor], suffix: tuple[torch.Tensor, torch.Tensor],
                  suffix_start: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` ``[B, H, D]`` (q's dtype) = the LSE merge of ``launch_suffix_partials``' chunks and each
    grouped row's valid prefix chunks from ``launch_prefix`` (the header's count, clamped to the
    partials' depth); returns ``out``."""
    (po, pl), (so, sl) = prefix, suffix
    B, H, D = out.shape
    block_h = min(16, triton.next_power_of_2(H))
    _merge_cascade_kernel[(B, triton.cdiv(H, block_h))](
        po, pl, so, sl, suffix_start, tiles.view(-1)[1:2], out, po.shape[0], H,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        so.stride(0), so.stride(1), so.stride(2), sl.stride(0), sl.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_H=block_h, KV_SPLITS=so.shape[0], num_warps=4)
    return out


# (device index, priority) -> the side stream the concurrent cascade runs its prefix kernel on: created
# once (a stream made per call would be a new one inside every graph capture and every eager step)
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    key = (torch.device(device).index or 0, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=priority)
    return _SIDE_STREAMS[key]


def concurrent_cascade(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, suffix_start: torch.Tensor, tiles: torch.Tensor, scale: float,
                       rule: CascadeLaunchRule, launch: DecodeLaunch | None = None) -> torch.Tensor:
    """Cascade decode with the prefix kernel beside the suffix kernel (``rule.concurrent_prefix``):
    the prefix on a side stream, the suffix (``launch_suffix_partials``) on the current one, then
    ``merge_cascade`` after the join. Under CUDA-graph capture the fork / join become two parallel
    branches of the graph. Off CUDA (the interpreter) the same kernels run in sequence.

    Memory: every buffer the side stream touches is allocated on the current stream before the fork,
    and the current stream waits for the side stream before the merge, so nothing the caching
    allocator frees afterwards (on the current stream, or in a graph's pool) can be reused while
    the prefix kernel still runs: no ``record_stream`` needed."""
    prefix = prefix_partials(q, rule)
    out = torch.empty_like(q)
    if q.device.type != "cuda":
        launch_prefix(q, k_cache, v_cache, block_tables, tiles, scale, rule, prefix)
        suffix = launch_suffix_partials(q, k_cache, v_cache, block_tables, context_lens, suffix_start, scale, rule,
                                        launch)
        return merge_cascade(prefix, suffix, suffix_start, tiles, out)
    current = torch.cuda.current_stream(q.device)
    side = side_stream(q.device, current.priority)
    side.wait_stream(current)  # the fork: q, the caches and the plan are ready
    with torch.cuda.stream(side):
        launch_prefix(q, k_cache, v_cache, block_tables, tiles, scale, rule, prefix)
    suffix = launch_suffix_partials(q, k_cache, v_cache, block_tables, context_lens, suffix_start, scale, rule,
                                    launch)
    current.wait_stream(side)  # the join: the merge reads the prefix partials
    return merge_cascade(prefix, suffix, suffix_start, tiles, out)


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor, suffix_start: torch.Tensor,
                             tiles: torch.Tensor, scale: float, rule: CascadeLaunchRule | None = None,
                             launch: DecodeLaunch | None = None) -> torch.Tensor:
    """Like ``paged_decode_attention`` with a plan from ``cascade.plan_cascade``:
    suffix_start ``[B]`` int32, tiles ``[1 + T, 2 + MPT]`` int32 (header row holding the
    active tile count and the step's prefix chunk count, then ``cascade.py``'s tile rows).
    Rows with ``suffix_start == 0`` get plain paged decode.

    ``rule``: the launch (default ``cascade.CASCADE_RULE``, read at call time); ``launch``
    overrides the suffix decode's (default ``cascade_suffix_launch(rule, batch_rows=B, k_cache=k_cache)``; the
    packed variant takes no suffix split-KV). Graph-safe: kernels and grids depend on ``tiles.shape``, the rule
    and the batch size only; the tile and chunk counts are read on the device (a header count
    above ``rule.max_splits`` is clamped). ``rule.concurrent_prefix``: ``concurrent_cascade`` (the
    prefix and suffix kernels on two streams, then a merge kernel; the base suffix kernel only)."""
    rule = rule or cascade_module.CASCADE_RULE
    if rule.concurrent_prefix:
        return concurrent_cascade(q, k_cache, v_cache, block_tables, context_lens, suffix_start, tiles, scale, rule,
                                  launch)
    partials = launch_prefix(q, k_cache, v_cache, block_tables, tiles, scale, rule)
    return launch_suffix(q, k_cache, v_cache, block_tables, context_lens, suffix_start, tiles, scale, partials,
                         rule, launch)
