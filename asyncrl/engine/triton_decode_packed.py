"""Packed-heads paged decode: several KV heads per program, for small GQA groups (opt-in).

Why: the base kernel (``triton_decode._paged_decode_kernel``) runs one program per (sequence, kv
head) and pads the GQA group to 16 rows for ``tl.dot``: at group 2 (Qwen3-0.6B) 14 of 16 rows are
zeros, each program reads only 256 B of K per token, and at short contexts a program lives for
4-5 tiles, so the pipeline prologue dominates (bench/RESULTS.md, "Decode-kernel launch sweep").

Here a program owns ``HP`` kv heads of one sequence (``HP * GROUP <= ROWS`` rows, ROWS >= 16, e.g.
4 kv heads x 2 q heads = 8 rows; 8 x 2 = 16 fills them, but see ``MAX_COLUMNS``). K/V tiles are
``[BLOCK_N tokens, HP * BLOCK_D]``: a token's heads are adjacent in the ``[N, page, Hkv, D]`` cache,
so each token's row of the tile is one contiguous run, copied in 16-byte ``cp.async`` pieces. The
query is laid out block-diagonally, ``q_bd[r, c] = q[r, c % BLOCK_D]`` where column ``c`` belongs
to row ``r``'s kv head, else 0, so ONE ``tl.dot(q_bd, k^T)`` gives every row the scores against its
own head's keys (the zeros make the other heads' columns vanish; the tensor cores have ~10x the
FLOPs this needs at 4.8 TB/s). The PV product is computed transposed, ``acc^T += v^T @ p^T``
(``[HP * BLOCK_D, ROWS]``), and each row keeps only its own head's columns at the store.
Transposed because as the dot's B operand an e4m3 V tile was copied in 8-byte pieces (the shared
layout's vector is 8 elements), as the A operand in 16-byte ones like K (sm90 PTX, ``--offline``).
Fewer, longer-lived programs: at batch 256, 8 kv heads and 4 per program, 512 programs each walk
the whole context in tiles of 16 tokens (the base kernel: 2,048 programs of 4-8 tiles of 64).

``BT_REGS``: the block-table row is read once per work item (``triton_decode.table_regs``), so the
pipeline can run ``num_stages - 1`` tiles ahead: the "more stages" lever for short contexts.

``PERSISTENT``: the grid is ``min(items, SMs x per_sm)`` programs looping over the work items
(sequence, head group, KV split) -- programs stay resident and the launch does not depend on the
batch's shape beyond ``items``.

FP8 (e4m3) caches: the tile is loaded as 1-byte values (contiguous along the head dim: 16-byte
vectors) and converted to the query's dtype in registers; the cache stores no scale (vLLM's
default ``k_scale = v_scale = 1.0``), so dequantisation is the cast.

Not here: several query tokens per sequence (speculative verify) -- that stays on the base kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _packed_decode_kernel(Q, K, V, O, BT, CL, START, NSP, PO, PL, SO, SL, scale, total_items, max_parts,
                          stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                          stride_ot, stride_oh, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
                          GROUP: tl.constexpr, HP: tl.constexpr, HGROUPS: tl.constexpr, ROWS: tl.constexpr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                          IEEE: tl.constexpr, CASCADE: tl.constexpr,
                          KV_SPLITS: tl.constexpr, PERSISTENT: tl.constexpr, BT_REGS: tl.constexpr):
    """Work item w = (sequence b, head group hg, KV chunk sid), w = (b * HGROUPS + hg) * KV_SPLITS + sid.
    Row r (< HP * GROUP) is q head ``hg * HP * GROUP + r`` (kv head ``hg * HP + r // GROUP``);
    column c is head dim ``c % BLOCK_D`` of kv head ``hg * HP + c // BLOCK_D``."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, HP * BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    row_head = r // GROUP          # kv head of row r, within the group of HP
    col_head = c // BLOCK_D        # kv head of column c, within the group of HP
    dd = c % BLOCK_D
    rmask = r < HP * GROUP
    cmask = dd < D
    own = (row_head[:, None] == col_head[None, :]) & rmask[:, None] & cmask[None, :]  # [ROWS, HP*BLOCK_D]
    if PERSISTENT:
        w_first, w_step = tl.program_id(0), tl.num_programs(0)
    else:
        w_first, w_step = tl.program_id(0), total_items  # one item per program
    for w in range(w_first, total_items, w_step):
        sid = w % KV_SPLITS
        hg = (w // KV_SPLITS) % HGROUPS
        b = w // (KV_SPLITS * HGROUPS)
        ctx = tl.load(CL + b)
        first = 0
        if CASCADE:
            first = tl.load(START + b)  # tokens [0, first) come from the prefix kernel
        last = ctx
        if KV_SPLITS > 1:
            span = tl.cdiv(tl.cdiv(ctx, KV_SPLITS), BLOCK_N) * BLOCK_N
            first = sid * span
            last = tl.minimum(first + span, ctx)
        heads = hg * (HP * GROUP) + r                        # q head of each row
        kv_col = (hg * HP + col_head) * stride_kh + dd       # cache offset of each column within a token
        if BT_REGS > 0:
            bt_idx = tl.arange(0, BT_REGS)
            bt_row = tl.load(BT + b * stride_bt + bt_idx, mask=bt_idx < tl.cdiv(last, PAGE), other=0)
        q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + dd[None, :], mask=own, other=0.0)
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([HP * BLOCK_D, ROWS], dtype=tl.float32)  # transposed: V is the dot's A (see module doc)
        for start in range(first, last, BLOCK_N):
            tok = start + n
            kmask = tok < last
            if BT_REGS > 0:  # the row's table is in registers: no load on the K/V address chain
                blk = tl.sum(tl.where(bt_idx == start // PAGE, bt_row, 0), 0).to(tl.int64)
            elif PAGE % BLOCK_N == 0:  # the tile lies in one block: one table lookup per tile
                blk = tl.load(BT + b * stride_bt + start // PAGE).to(tl.int64)
            else:
                blk = tl.load(BT + b * stride_bt + tok // PAGE, mask=kmask, other=0).to(tl.int64)
            off = (blk * stride_kb + (tok % PAGE) * stride_ks)[:, None] + kv_col[None, :]
            if D == BLOCK_D:  # no column mask: its constancy would cap the copy width (see below)
                tmask = kmask[:, None]
            else:
                tmask = kmask[:, None] & cmask[None, :]
            k = tl.load(K + off, mask=tmask, other=0.0).to(Q.dtype.element_ty)  # [BLOCK_N, HP*BLOCK_D]
            if IEEE:  # fp32 queries (tests): no tf32 rounding
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK_N]
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + off, mask=tmask, other=0.0).to(Q.dtype.element_ty)
            if IEEE:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p.to(v.dtype)), input_precision="ieee")
            else:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p.to(v.dtype)))
            m = m_new
        if CASCADE:  # merge the shared prefix's NSP[0] parts by LSE (as the base kernel does)
            pmask = rmask & (first > 0)
            nsp = 1
            if max_parts > 1:  # one part (specialised when 1): no load
                nsp = tl.minimum(tl.maximum(tl.load(NSP), 1), max_parts)
            for sp in range(0, nsp):
                lse_p = tl.load(PL + sp * stride_pls + b * stride_plt + heads, mask=pmask, other=float("-inf"))
                o_p = tl.load(PO + sp * stride_pos + b * stride_pot + heads[:, None] * stride_poh + dd[None, :],
                              mask=own & pmask[:, None], other=0.0).to(tl.float32)
                m_new = tl.maximum(m, lse_p)
                alpha = tl.exp(m - m_new)
                beta = tl.exp(lse_p - m_new)
                acc = acc * alpha[None, :] + tl.trans(o_p * beta[:, None])
                l = l * alpha + beta
                m = m_new
        if KV_SPLITS > 1:  # partial (out, lse) of this chunk; an empty chunk writes lse = -inf
            lsafe = tl.where(l > 0, l, 1.0)
            rows = sid * stride_pos + b * stride_pot + heads * stride_poh
            tl.store(SO + rows[:, None] + dd[None, :], tl.trans(acc / lsafe[None, :]), mask=own)
            tl.store(SL + sid * stride_pls + b * stride_plt + heads, m + tl.log(lsafe), mask=rmask)
        else:
            out = tl.trans(acc / l[None, :])
            tl.store(O + b * stride_ot + heads[:, None] * stride_oh + dd[None, :], out.to(O.dtype.element_ty),
                     mask=own)


# Columns (heads x padded head dim) of a program's K/V tile and transposed accumulator, at most:
# 512 keeps the [512, 16] fp32 accumulator at 32 registers a thread with 8 warps, so two programs fit
# an SM (sm90 offline compile, bench/paged_decode_variants.py --offline: 4 heads x 128 = 102
# registers bf16 / 128 e4m3 at a 16-token tile; 8 heads x 128 = 222 / 241, one program per SM).
MAX_COLUMNS = 512


def heads_per_program(group: int, hkv: int, requested: int = 0, block_d: int = 128) -> int:
    """kv heads per program: ``requested``, else the most (a power of 2 dividing ``hkv``) whose
    ``HP * group`` rows fit one 16-row ``tl.dot`` and whose ``HP * block_d`` columns stay within
    ``MAX_COLUMNS`` (D 128: group 1, 2, 4 -> 4, group 8 -> 2, group >= 16 -> 1)."""
    if requested:
        if hkv % requested:
            raise ValueError(f"heads_per_program={requested} does not divide the {hkv} kv heads")
        return requested
    hp = 1
    while hp * 2 * group <= 16 and hkv % (hp * 2) == 0 and hp * 2 * block_d <= MAX_COLUMNS:
        hp *= 2
    return hp


def launch_packed(q, k_cache, v_cache, out, block_tables, context_lens, scale, launch, cascade=None):
    """The packed-heads kernel for one query token per sequence (``launch.variant == "packed"``):
    q ``[B, H, D]``, caches ``[N, page, Hkv, D]`` -> ``out`` ``[B, H, D]``; ``cascade`` as in
    ``triton_decode._launch_decode``. Split-KV partials are merged by the base module's kernel."""
    from asyncrl.engine.triton_decode import _merge_splits_kernel, _programs, kv_splits_for, table_regs

    B, H, D = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    block_d = max(16, triton.next_power_of_2(D))
    hp = heads_per_program(group, hkv, launch.heads_per_program, block_d)
    hgroups = hkv // hp
    splits = 1 if cascade is not None else kv_splits_for(B, hgroups, q.device, launch)
    assert splits & (splits - 1) == 0, "kv_splits must be a power of 2 (the merge kernel's tl.arange)"
    start, nsp, po, pl = cascade if cascade is not None else (context_lens, context_lens, out[None],
                                                              out[None, :, :, 0])
    if splits > 1:
        so = torch.empty(splits, B, H, D, dtype=torch.float32, device=q.device)
        sl = torch.empty(splits, B, H, dtype=torch.float32, device=q.device)
        po, pl = so, sl
    else:
        so, sl = po, pl
    block_n = launch.fp8_block_n if (launch.fp8_block_n and k_cache.element_size() == 1) else launch.block_n
    items = B * hgroups * splits
    bt_regs = table_regs(block_tables, page, block_n, launch)
    grid = min(items, _programs(q.device, launch.persistent_per_sm)) if launch.persistent_per_sm else items
    _packed_decode_kernel[(max(1, grid),)](
        q, k_cache, v_cache, out, block_tables, context_lens, start, nsp, po, pl, so, sl, scale, items, po.shape[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        GROUP=group, HP=hp, HGROUPS=hgroups, ROWS=max(16, triton.next_power_of_2(hp * group)), D=D,
        BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        CASCADE=cascade is not None, KV_SPLITS=splits,
        PERSISTENT=bool(launch.persistent_per_sm), BT_REGS=bt_regs,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if splits > 1:
        _merge_splits_kernel[(B, H)](
            so, sl, out, so.stride(0), so.stride(1), so.stride(2), sl.stride(0), sl.stride(1),
            out.stride(0), out.stride(1), D=D, BLOCK_D=block_d, KV_SPLITS=splits, num_warps=4)
    return out
