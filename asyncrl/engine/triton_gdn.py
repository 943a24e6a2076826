"""Triton kernel: one decode step of the gated delta rule, states read and written in place.

``gated_delta_decode(q, k, v, g, beta, state, slots)``: for each sequence b and v-head h, with
``S = state[slots[b], h]`` ``[K, V]`` (updated in place; stored fp32, or bf16/fp16 with
``mamba_ssm_cache_dtype``: loaded into fp32, updated in fp32, rounded once to nearest on the store):

    S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q

q and k are L2-normalised in the kernel (fp32) and q scaled by K^-1/2; v-head h reads k-head
``h // (HV / Hk)``. The same arithmetic as transformers' ``torch_recurrent_gated_delta_rule``
(and our ``gated_delta.delta_rule_recurrent``). Slot ids are a device tensor, so one launch
serves any batch and the step is CUDA-graph capturable (FLA's fused recurrent kernel copies
whole states in and out instead). One program owns a ``[K, BLOCK_V]`` tile of one head's state:
the state is read once and written once per step, which bounds decode at batch B by
``2 * B * layers * HV * K * V * itemsize`` bytes of traffic: a bf16 state halves the dominant term
of a Qwen3.5 decode step (1 MiB per layer per sequence in fp32 at the 0.8B shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr,
                       stride_qb, stride_kb, stride_vb, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, scale):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (HV // HK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < K
    mv = offs_v < V
    q = tl.load(q_ptr + b * stride_qb + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + b * stride_vb + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * HV + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * HV + h).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + ((slot * HV + h) * K + offs_k[:, None]) * V + offs_v[None, :]
    m2 = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m2)  # fp32: as is
    tl.store(o_ptr + (b * HV + h) * V + offs_v, o, mask=mv)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, block_v: int = 0, num_warps: int = 4) -> torch.Tensor:
    """q, k ``[B, Hk, K]``, v ``[B, HV, V]``, g, beta ``[B, HV]``, state ``[slots, HV, K, V]`` fp32,
    bf16 or fp16 (updated in place), slots ``[B]`` -> o ``[B, HV, V]`` fp32. q, k, v may be
    row-strided views (the conv output split per head: no copies), each row's heads contiguous.
    ``block_v`` (0: a tile row of 128 contiguous bytes, 32 fp32 / 64 bf16 values, one full memory
    transaction) and ``num_warps``: the tile, fixed rather than autotuned because decode runs inside
    CUDA graphs (``bench/qwen35_levers.py`` sweeps them on a GPU)."""
    B, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v = (_rows_packed(t) for t in (q, k, v))
    o = torch.empty(B, HV, V, dtype=torch.float32, device=q.device)
    block_v = min(block_v or 128 // state.element_size(), triton.next_power_of_2(V))
    grid = (B, HV, triton.cdiv(V, block_v))
    _gdn_decode_kernel[grid](q, k, v, g.contiguous(), beta.contiguous(), state, slots.contiguous(), o,
                             q.stride(0), k.stride(0), v.stride(0), HK, HV, K, V, triton.next_power_of_2(K),
                             block_v, K ** -0.5, num_warps=num_warps)
    return o


def _rows_packed(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, D]`` as is when each row's ``[H, D]`` is contiguous (any row stride), else a copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
