"""Fused MoE on GPU: a grouped GEMM over the (token, expert) pairs routed to each expert.

The T x K routed pairs are sorted by expert and each expert's run padded to a multiple of the
tile height ``block_m`` (``align_pairs``: torch ops on the device, no host sync, fixed output
sizes, so the step stays CUDA-graph capturable). One program computes a ``block_m x BLOCK_N``
tile of one expert's GEMM, reading that expert's weights once for ``block_m`` pairs (vLLM's
``fused_moe`` design, re-implemented), in three launches:

    h[p]   = silu(x[t] W13_e[:I]^T) * (x[t] W13_e[I:]^T)      kernel 1: gate and up tiles of the
                                                               same columns in one program, h written once
    y[p]   = weight[p] * h[p] W2_e^T                           kernel 2: weight in the epilogue (fp32)
    out[t] = sum_k y[t * K + k]                                kernel 3: fixed order, fp32 accumulation

with p = t * K + k, e = ids[t, k]. The top-k sum is a separate reduction rather than fp32 atomic
adds into ``out``: atomics would add the K contributions in a run-dependent order, so the bf16
output (and the engine's log-probs) could differ by an ulp between identical runs; the extra
traffic (``y``: T*K*H bf16, written and read once) is an estimated 5-10% of a prefill layer and
~1.5% of a decode layer (which reads every hit expert's weights).

Tile shapes come from ``triton_moe_tiles.pick_tiles`` (a table per layer shape and pairs bucket,
tuned by ``bench/moe_gemm_tune.py``). At prefill sizes the table may pick ``torch._grouped_mm``
(CUTLASS grouped GEMM, sm90+ bf16) for the two GEMMs instead (``experts_grouped_mm``), with the
same SiLU*mul and top-k sum kernels around it.

Weights stay in transformers' packed layout ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; an
expert-parallel shard is a contiguous range of E. Checked against ``moe.moe_experts_torch``
under ``TRITON_INTERPRET=1`` on CPU (tests/engine/test_triton_moe.py).
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from asyncrl.engine.triton_moe_align import moe_align_block_size
from asyncrl.engine.triton_moe_tiles import GemmTile, MoeTiles, pick_tiles

# triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (bit patterns as integers):
# under TRITON_INTERPRET=1 the operands are upcast to fp32 first (everything else unchanged).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int = 16):
    """ids ``[T, K]`` -> (sorted_pairs ``[P]`` int32: pair index t*K + k grouped by expert, each
    run padded to ``block_m`` with the sentinel T*K; block_expert ``[P / block_m]`` int32: the
    expert of each block, -1 past the last). ``P = T*K + E*(block_m - 1)`` rounded up: a bound
    that does not depend on the routing."""
    flat = ids.reshape(-1)
    M = flat.numel()
    P = triton.cdiv(M + num_experts * (block_m - 1), block_m) * block_m
    # fixed-size count (bincount's output size depends on the data: a host sync, no CUDA graph)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = padded.cumsum(0)
    seg_start = seg_end - padded
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    first = counts.cumsum(0) - counts  # index of each expert's first pair in the sorted order
    rank = torch.arange(M, device=ids.device) - first[expert_sorted]
    sorted_pairs = torch.full((P,), M, dtype=torch.int32, device=ids.device)
    sorted_pairs[seg_start[expert_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, P, block_m, device=ids.device)
    block_expert = torch.searchsorted(seg_end, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_start < seg_end[-1], block_expert, -1)
    return sorted_pairs, block_expert


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _dot(a, w, acc, DOT_FP32: tl.constexpr):
    """acc + a @ w; fp32 operands in IEEE precision (no TF32) when DOT_FP32."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, w, acc)
    return out


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, weight_ptr,
                     num_pairs, N, a_row_div, stride_am, stride_we, stride_wn, stride_cm,
                     K: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``BLOCK_M x BLOCK_N`` tile of c for the pairs p of one expert block (a_p = a[p // a_row_div]):

        GATED:  c[p, n] = silu(a_p . w[e, n]) * (a_p . w[e, N + n])    (w: gate rows, then up rows)
        else:   c[p, n] = a_p . w[e, n]  (x weight[p] if MUL_WEIGHT)

    The program id runs over N fastest: the programs in flight share one A block and one
    expert's weights, so both stay in L2 (at prefill A is re-read once per N tile otherwise).
    K (= H or I) is a model constant: compiled once per layer shape."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < num_pairs
    rows = (pair // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:  # no K mask: keeps the loads vectorized along K
            a_mask = valid[:, None]
            w_mask = n_ok[None, :]
        else:
            a_mask = valid[:, None] & (offs_k[None, :] < K - k0)
            w_mask = n_ok[None, :] & (offs_k[:, None] < K - k0)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = _dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, DOT_FP32)
        if GATED:
            acc_up = _dot(a, tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0), acc_up, DOT_FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, I, stride_gu, stride_h, BLOCK: tl.constexpr):
    """h[r, :] = silu(gu[r, :I]) * gu[r, I:], in fp32, one rounding (the grouped_mm path)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + r * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + r * stride_h + offs, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_topk_kernel(y_ptr, out_ptr, rows_ptr, weight_ptr, H, stride_y, stride_out,
                     TOP_K: tl.constexpr, GATHER: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, :] = sum_k (weight[p] x) y[row(p), :] for p = t*TOP_K + k, k = 0..TOP_K-1 in order,
    accumulated in fp32: deterministic. row(p) = rows[p] if GATHER else p."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        p = t * TOP_K + k
        if GATHER:
            row = tl.load(rows_ptr + p).to(tl.int64)
        else:
            row = p
        v = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        if MUL_WEIGHT:
            v = v * tl.load(weight_ptr + p).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launches --------------------------------------------------------------------------------
_STAGES_THAT_FIT: dict[tuple, int] = {}  # (tile, dtype, K, gated) -> num_stages after an OutOfResources


def _moe_gemm(a, w, out, sorted_pairs, block_expert, block_m: int, tile: GemmTile, a_row_div: int,
              gated: bool = False, weights=None):
    """out ``[num_pairs, N]`` for the pairs in ``sorted_pairs`` (see ``_moe_gemm_kernel``); w
    ``[E, 2N or N, K]`` with unit stride along K. A tile whose pipeline does not fit in shared
    memory is retried with fewer stages (remembered), with a warning naming the table row."""
    num_pairs, N = out.shape
    K = a.shape[1]
    if a.stride(1) != 1 or w.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("fused MoE: activations, weights and output need unit stride along their last dim")
    grid = (block_expert.numel() * triton.cdiv(N, tile.block_n),)
    key = (tile, a.dtype, K, gated)
    stages = _STAGES_THAT_FIT.get(key, tile.num_stages)
    while True:
        try:
            _moe_gemm_kernel[grid](a, w, out, sorted_pairs, block_expert, weights if weights is not None else out,
                                   num_pairs, N, a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                   K=K, GATED=gated, MUL_WEIGHT=weights is not None,
                                   DOT_FP32=a.dtype == torch.float32 or _INTERPRET,
                                   BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                                   num_warps=tile.num_warps, num_stages=stages)
            break
        except OutOfResources as err:
            if stages <= 1:
                raise
            stages, too_big = stages - 1, err
    if key not in _STAGES_THAT_FIT:
        _STAGES_THAT_FIT[key] = stages
        if stages != tile.num_stages:
            warnings.warn(f"fused MoE tile {tile} (K={K}, {a.dtype}) does not fit ({too_big}); "
                          f"using num_stages={stages}: fix its row in triton_moe_tiles.TILE_TABLE")


def sum_topk(y: torch.Tensor, top_k: int, out_dtype: torch.dtype, rows=None, weights=None) -> torch.Tensor:
    """``[T, H]``: out[t] = sum_k (weights[t, k] x) y[rows[t*K + k] or t*K + k], fp32 accumulation."""
    num_pairs, H = y.shape
    T = num_pairs // top_k
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(H))
    if T:
        _sum_topk_kernel[(T, triton.cdiv(H, block_h))](
            y, out, rows if rows is not None else y, weights if weights is not None else y, H, y.stride(0),
            out.stride(0), TOP_K=top_k, GATHER=rows is not None, MUL_WEIGHT=weights is not None, BLOCK_H=block_h)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[M, 2I] -> [M, I]``: silu(gate) * up in fp32, rounded once to the input dtype."""
    M, two_i = gate_up.shape
    inter = two_i // 2
    h = torch.empty(M, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if M:
        _silu_mul_kernel[(M, triton.cdiv(inter, block))](gate_up, h, inter, gate_up.stride(0), h.stride(0),
                                                        BLOCK=block)
    return h


# ---- the two backends --------------------------------------------------------------------------
def experts_triton(x, w13, w2, weights, ids, tiles: MoeTiles) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` through the three Triton kernels (module docstring)."""
    T, top_k = ids.shape
    E, two_i, H = w13.shape
    sorted_pairs, block_expert = moe_align_block_size(ids, E, tiles.block_m)  # align_pairs: the torch reference
    x = x.contiguous()
    h = torch.empty(T * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, h, sorted_pairs, block_expert, tiles.block_m, tiles.up, top_k, gated=True)
    y = torch.empty(T * top_k, H, dtype=x.dtype, device=x.device)
    _moe_gemm(h, w2, y, sorted_pairs, block_expert, tiles.block_m, tiles.down, 1,
              weights=weights.reshape(-1).contiguous())
    return sum_topk(y, top_k, x.dtype)


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs CUTLASS's grouped GEMM (no host sync) for bf16 on sm90+; its
    operands need 16-byte-aligned starts and rows (I and H multiples of 8)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and w13.shape[1] % 16 == 0 and w13.shape[2] % 8 == 0
            and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0)


def experts_grouped_mm(x, w13, w2, weights, ids) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` with ``torch._grouped_mm`` for the two GEMMs: rows
    gathered in expert order (``offs``: each expert's end row, int32), SiLU*mul and the weighted
    top-k sum (gathering each pair's row back) in the Triton kernels above."""
    T, top_k = ids.shape
    E = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # sorted row -> pair
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    # one expression: the gathered x and gate_up are freed as soon as each is consumed (peak
    # per pair: H + 2I elements, then I + H; the Triton path holds I + H)
    h = silu_mul(torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    del h
    row_of_pair = torch.empty_like(order)
    row_of_pair[order] = torch.arange(order.numel(), device=ids.device)
    return sum_topk(y, top_k, x.dtype, rows=row_of_pair, weights=weights.reshape(-1).contiguous())


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, weights/ids ``[T, K]`` -> ``[T, H]``.
    ``tiles``: the table's row for this shape unless given (tests, the tune bench)."""
    T, top_k = ids.shape
    E, two_i, H = w13.shape
    if tiles is None:
        tiles = pick_tiles(T * top_k, E, two_i // 2, H)
    if tiles.backend == "grouped_mm" and grouped_mm_supported(x, w13, w2):
        return experts_grouped_mm(x, w13, w2, weights, ids)
    return experts_triton(x, w13, w2, weights, ids, tiles)
