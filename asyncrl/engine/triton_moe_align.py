"""The routing glue of a fused-MoE layer in three Triton launches: route (1) and align (2).

Before this, each MoE layer of each decode step ran ~15 small torch kernels between the router
GEMM and the grouped GEMM (softmax, ``topk``'s gatherTopK + bitonic sort, the renormalising
division and cast; the align's ``index_add_`` counts, a radix ``argsort``, two ``cumsum``,
``searchsorted``, scatter): ~60-80 us per layer, 3-4 ms of a 24.5 ms Qwen3-30B-A3B step at batch
256 (bench/moe_glue.py measures both).

``fused_route(logits, top_k, renormalize)``: router logits ``[T, E]`` -> (weights ``[T, K]`` in
the logits' dtype, ids ``[T, K]`` int64), transformers' ``Qwen3MoeTopKRouter`` steps in one
program per ``BLOCK_T`` rows: fp32 softmax, top-k, renormalise iff asked, cast back. The top-k is
``K`` rounds of arg-max over the logits with the smallest index winning a tie; softmax is
monotonic, so the chosen set is torch's (``topk`` on the probabilities also keeps the smallest
indices of a value tied at the k-th place) and the order is by value, ties by index (torch's
CUDA bitonic sort leaves tied values in an unspecified order). The probabilities are computed
in fp32 like torch's, with another exp and summation order: a few fp32 ulps apart at most.
With ``record`` it also writes routing replay's int16 ids at the tokens' KV slots (what
``SparseMoeBlock`` did with a cast and an ``index_put`` per layer).

``moe_align_block_size(ids, E, block_m)``: vLLM's ``moe_align_block_size`` idea (re-implemented):
the ``T*K`` (token, k) pairs grouped by expert, each expert's run padded to ``block_m`` with the
sentinel ``T*K``, and the expert of each ``block_m`` block (-1 past the last). Launch 1 counts each
chunk's pairs per expert (``[chunks, E]``); launch 2 (one program per chunk) sums those counts into
the padded segment offsets and writes its chunk's pairs at ``segment start + pairs of the expert in
earlier chunks + rank in this chunk``; program 0 also writes the pads and the block -> expert map.
Output sizes depend on ``T, K, E, block_m`` only, no host sync: CUDA-graph capturable. The output
equals ``triton_moe.align_pairs`` (the torch reference) element for element: pairs of one expert in
ascending pair order.

Checked against the torch versions under ``TRITON_INTERPRET=1`` on CPU
(tests/engine/test_triton_moe_align.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


# ---- route: softmax -> top-k -> renormalise ---------------------------------------------------
@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t,
                  slots_ptr, record_ptr, stride_rs, record_col,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, RECORD: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Rows ``[pid * BLOCK_T, +BLOCK_T)``: weights/ids ``[T, TOP_K]`` from logits ``[T, E]``;
    ``RECORD``: the ids also (int16) at ``record[slots[t], record_col, :]`` (routing replay)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < E), other=float("-inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past T: finite, never stored
    m = tl.max(x, axis=1)
    ex = tl.exp(x - m[:, None])
    probs = ex / tl.sum(ex, axis=1)[:, None]  # softmax(logits, dtype=float32)
    key = tl.where(cols[None, :] < E, x, float("-inf"))  # selection on the logits: same order as probs
    slot = tl.arange(0, K_PAD)
    top_p = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(key, axis=1, tie_break_left=True)  # [BLOCK_T]: the smallest index of the max
        hit = cols[None, :] == best[:, None]
        p = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        top_p = tl.where(slot[None, :] == k, p[:, None], top_p)
        top_i = tl.where(slot[None, :] == k, best[:, None], top_i)
        key = tl.where(hit, float("-inf"), key)
    if RENORMALIZE:
        top_p = top_p / tl.sum(top_p, axis=1)[:, None]  # padded slots hold 0
    out = rows.to(tl.int64)[:, None] * TOP_K + slot[None, :]
    ok = row_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_p.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=ok)
    if RECORD:
        kv_slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        at = kv_slot[:, None] * stride_rs + record_col * TOP_K + slot[None, :]
        tl.store(record_ptr + at, top_i.to(record_ptr.dtype.element_ty), mask=ok)


def fused_route(logits: torch.Tensor, top_k: int, renormalize: bool,
                record: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, K]`` in the logits' dtype, ids ``[T, K]`` int64),
    as ``moe.route_torch`` (transformers' router) in one launch. ``record = (buffer [S, L, K] int16,
    slots [T], column)``: the ids are also written at ``buffer[slots, column]`` (routing replay's
    record, ``SparseMoeBlock``; no separate cast and index_put)."""
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={E}")
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block_e = triton.next_power_of_2(E)
    # 512 logits per program, one warp per row at E = 128: sm_90 ptxas gives 32 registers (a 32 x 128
    # tile: 255, and 4x the code)
    block_t = max(1, min(16, 512 // block_e))
    if record is not None:
        buffer, slots, column = record
        if buffer.shape[2] != top_k or buffer.stride(2) != 1 or buffer.stride(1) != top_k:
            raise ValueError(f"routing record buffer {tuple(buffer.shape)} must be contiguous [slots, layers, {top_k}]")
        rec = (slots, buffer, buffer.stride(0), column)
    else:
        rec = (ids, ids, 0, 0)  # unused (RECORD=False)
    _route_kernel[(triton.cdiv(T, block_t),)](logits, weights, ids, T, E, logits.stride(0), *rec, TOP_K=top_k,
                                              K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                                              RECORD=record is not None, BLOCK_T=block_t, BLOCK_E=block_e,
                                              num_warps=4)
    return weights, ids


# ---- align: pairs grouped by expert in block_m-padded runs -----------------------------------
@triton.jit
def _count_kernel(ids_ptr, counts_ptr, M, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[c, e] = pairs of chunk c (pairs ``[c * CHUNK, +CHUNK)``) routed to expert e."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        offs = c * CHUNK + s + tl.arange(0, SUB)
        e = tl.load(ids_ptr + offs, mask=offs < M, other=-1).to(tl.int32)
        acc += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * BLOCK_E + experts, acc)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, pairs_ptr, block_expert_ptr, M, num_chunks, num_blocks,
                  CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                  BLOCK_TILE: tl.constexpr, PAD_TILE: tl.constexpr):
    """Chunk c's pairs to ``seg_start[e] + (pairs of e in chunks < c) + (rank among e's in c)``;
    program c also writes ``block_expert`` (and the all-sentinel tail) of its share of the blocks,
    program 0 the pads of each run. Loops have constexpr bounds (the interpreter's ``range``
    cannot take a runtime bound under numpy 2) and 2-D tiles stay <= ~4k elements."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, CHUNKS_PAD, ROWS):
        r = r0 + tl.arange(0, ROWS)
        tile = tl.load(counts_ptr + r[:, None] * BLOCK_E + experts[None, :], mask=(r < num_chunks)[:, None], other=0)
        total += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((r < c)[:, None], tile, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    base = seg_start + before
    for s in range(0, CHUNK, SUB):
        offs = c * CHUNK + s + tl.arange(0, SUB)
        valid = offs < M
        e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        onehot = (experts[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_E, SUB]: scan along the last axis
        earlier = tl.cumsum(onehot, axis=1) - onehot  # same-expert pairs before this one in the sub-tile
        dst = tl.sum((earlier + base[:, None]) * onehot, axis=0)
        tl.store(pairs_ptr + dst, offs.to(tl.int32), mask=valid)
        base += tl.sum(onehot, axis=1)
    if c == 0:  # each run's padding, BLOCK_E x PAD_TILE slots at a time
        for j0 in range(0, BLOCK_M, PAD_TILE):
            pad = (seg_start + total)[:, None] + j0 + tl.arange(0, PAD_TILE)[None, :]
            tl.store(pairs_ptr + pad, tl.full([BLOCK_E, PAD_TILE], 0, tl.int32) + M, mask=pad < seg_end[:, None])
    end = tl.sum(padded, axis=0)
    j = tl.arange(0, BLOCK_M)
    for b0 in range(0, BLOCKS_PER_PROGRAM, BLOCK_TILE):  # this program's blocks, BLOCK_TILE at a time
        b = c * BLOCKS_PER_PROGRAM + b0 + tl.arange(0, BLOCK_TILE)
        start = b * BLOCK_M
        expert = tl.sum((seg_end[None, :] <= start[:, None]).to(tl.int32), axis=1)  # searchsorted(seg_end, right)
        tl.store(block_expert_ptr + b, tl.where(start < end, expert, -1), mask=b < num_blocks)
        tail = start[:, None] + j[None, :]  # blocks past the last run: all sentinel
        tl.store(pairs_ptr + tail, tl.full([BLOCK_TILE, BLOCK_M], 0, tl.int32) + M,
                 mask=(tail >= end) & (b < num_blocks)[:, None])


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """``P``: a bound on the padded pair list that does not depend on the routing."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[T, K]`` -> (sorted_pairs ``[P]`` int32, block_expert ``[P / block_m]`` int32), as
    ``triton_moe.align_pairs`` (see the module docstring) in two launches."""
    flat = ids.reshape(-1)
    M = flat.numel()
    P = padded_size(M, num_experts, block_m)
    if M == 0:
        return (torch.zeros(P, dtype=torch.int32, device=ids.device),
                torch.full((P // block_m,), -1, dtype=torch.int32, device=ids.device))
    block_e = triton.next_power_of_2(num_experts)
    # [E, SUB] one-hot tiles of 4,096 ints over 8 warps: 80 registers on sm_90, no spills (SUB 64: 250)
    sub = max(8, min(32, 4096 // block_e))
    chunk = max(4 * sub, triton.next_power_of_2(triton.cdiv(M, 128)))  # <= 128 chunks: one wave of programs
    num_chunks = triton.cdiv(M, chunk)
    assert num_chunks <= 128, num_chunks  # CHUNKS_PAD's bound
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(P // block_m, dtype=torch.int32, device=ids.device)
    flat = flat.contiguous()
    _count_kernel[(num_chunks,)](flat, counts, M, CHUNK=chunk, SUB=sub, BLOCK_E=block_e, num_warps=8)
    num_blocks = P // block_m
    per_program = triton.next_power_of_2(triton.cdiv(num_blocks, num_chunks))
    tile = max(1, 4096 // block_e)  # 2-D tiles of <= 4,096 ints (E = 512 at batch 1: 481 blocks in one program)
    _place_kernel[(num_chunks,)](flat, counts, sorted_pairs, block_expert, M, num_chunks, num_blocks,
                                 CHUNK=chunk, SUB=sub, BLOCK_E=block_e, BLOCK_M=block_m,
                                 CHUNKS_PAD=max(16, triton.next_power_of_2(num_chunks)), ROWS=16,
                                 BLOCKS_PER_PROGRAM=per_program, BLOCK_TILE=min(per_program, tile),
                                 PAD_TILE=min(block_m, tile), num_warps=8)
    return sorted_pairs, block_expert
