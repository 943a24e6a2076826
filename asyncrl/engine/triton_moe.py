"""Fused MoE on GPU: a grouped GEMM over the (token, expert) pairs routed to each expert.

The T x K routed pairs are sorted by expert and each expert's run padded to a multiple of
the tile height (16 at decode, 64 at prefill: ``pick_block_m``) (``align_pairs``: torch ops on the device, no host sync, fixed output sizes, so the
step stays CUDA-graph capturable). One program computes a ``BLOCK_M x BLOCK_N`` tile of one
expert's GEMM, reading that expert's weights once for ``BLOCK_M`` pairs (vLLM's ``fused_moe``
design, re-implemented):

    h[p]   = silu(x[token(p)] W13_e[:I]^T) * (x[token(p)] W13_e[I:]^T)     (kernel 1 + torch glue)
    y[p]   = weight[p] * h[p] W2_e^T                                       (kernel 2)
    out[t] = sum_k y[t * K + k]

Weights stay in transformers' packed layout ``w13 [E, 2I, H]``, ``w2 [E, H, I]``; an
expert-parallel shard is a contiguous range of E. Checked against ``moe.moe_experts_torch``
under ``TRITON_INTERPRET=1`` on CPU (tests/engine/test_triton_moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from asyncrl.engine.triton_moe_align import moe_align_block_size

BLOCK_M = 16  # rows (pairs) per tile when experts get few pairs each: decode
BLOCK_M_LARGE = 64  # ... and when they get many: prefill (vLLM's configs also grow BLOCK_M with M)


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Tile height for ``num_pairs`` routed pairs over ``num_experts``: each tile reads a
    ``BLOCK_N x H`` slice of one expert's weights for ``BLOCK_M`` pairs, so weight traffic is
    ``num_pairs / BLOCK_M`` tiles' worth. 16 keeps padding small at decode (Qwen3-30B-A3B at
    batch 256: 2,048 pairs over 128 experts, 16 each); prefill (16k tokens: ~1,000 pairs per
    expert) takes 64, reading each expert's weights 4x less often. Shapes only, no data: one
    choice per captured graph size."""
    return BLOCK_M_LARGE if num_pairs >= 4 * BLOCK_M_LARGE * num_experts else BLOCK_M


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
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


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, weight_ptr,
                         num_pairs, N, a_row_div, stride_am, stride_we, stride_wn, stride_cm,
                         K: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[p, :] = a[p // a_row_div, :] @ w[e]^T (x weight[p]) for the pairs p of block pid_m
    (K, the reduction width = H or I, is a model constant: compiled once per layer shape)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < num_pairs
    rows = (pair // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + kk[:, None],
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        if FP32:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a, w, out, sorted_pairs, block_expert, block_m, a_row_div, weights=None):
    num_pairs, N = out.shape
    K = a.shape[1]
    block_n, block_k = 64, 64 if K >= 64 else 32
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](a, w, out, sorted_pairs, block_expert, weights if weights is not None else out,
                               num_pairs, N, a_row_div, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                               K=K, MUL_WEIGHT=weights is not None, FP32=a.dtype == torch.float32,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, weights/ids ``[T, K]`` -> ``[T, H]``."""
    T, top_k = ids.shape
    E, two_i, H = w13.shape
    block_m = pick_block_m(T * top_k, E)
    sorted_pairs, block_expert = moe_align_block_size(ids, E, block_m)  # Triton; align_pairs: torch reference
    x = x.contiguous()
    gate_up = torch.empty(T * top_k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_pairs, block_expert, block_m, top_k)
    h = F.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]
    y = torch.empty(T * top_k, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(h.contiguous(), w2, y, sorted_pairs, block_expert, block_m, 1, weights.reshape(-1).contiguous())
    return y.view(T, top_k, H).sum(1)
