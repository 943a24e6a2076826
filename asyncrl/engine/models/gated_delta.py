"""Gated DeltaNet ops over per-sequence state slots: the causal conv and the gated delta rule.

Every op reads the state of slot ``slots[b]`` for sequence b (or zeros where ``init[b]`` is
False: a prefill from position 0) and writes the new state back in place, so a sequence's
state lives in one slot of the ``StatePool`` for its whole life.

Kernels: on CUDA, prefill runs flash-linear-attention's ``causal_conv1d`` and
``chunk_gated_delta_rule`` over the step's packed tokens (varlen via ``cu_seqlens``, one call per
layer for the whole step, the library made for it; ``pip install fla-core``;
``causal_conv_packed``, ``gated_delta_prefill_packed``) and decode our Triton kernel
``triton_gdn.gated_delta_decode`` (one token, state read and written in place through the slot
ids: CUDA-graph capturable; FLA's recurrent kernel takes no slot ids). On CPU (or without FLA)
the pure-torch recurrence over padded sequences runs (``gated_delta_prefill``); the tests check
it against transformers' own torch functions. The prefill conv is torch there (shifted
multiply-adds, see below); the decode conv is torch everywhere (one window per sequence,
``torch.compile``-fused on CUDA).

Shapes: q, k ``[.., Hk, K]``, v ``[.., HV, V]``, g (log-decay) and beta ``[.., HV]`` fp32;
state ``[slots, HV, K, V]`` fp32 (or bf16/fp16: ``mamba_ssm_cache_dtype``; every path computes in
fp32 from it and rounds the new state once when it stores it); conv state ``[slots, C, kernel - 1]``.
"""
from __future__ import annotations

import functools
import importlib

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.engine.models.decoder import _CudaCompiled


# ---- the short causal convolution -------------------------------------------------------------
# A depthwise conv of width W (4) is W shifted multiply-adds: done so here rather than with
# ``F.conv1d(groups=C)``, whose CUDA depthwise path is an order of magnitude slower than a naive
# kernel (pytorch/pytorch#75747; transformers warns about the same fallback without
# ``causal-conv1d``): at a 16k-token prefill of Qwen3.5-0.8B (C = 6144) it dominated the step.
# Products and sums are in fp32 (fp64 stays fp64), as a conv kernel accumulates.
def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def causal_conv_varlen(x: torch.Tensor, lens: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                       init: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over padded sequences, continuing from their conv states.

    x ``[B, L, C]`` (row b real for its first ``lens[b]`` tokens), weight ``[C, W]``. The W - 1
    inputs before each sequence come from ``conv_state[slots[b]]`` (zeros where not ``init``);
    the state is then set to the last W - 1 inputs up to ``lens[b]``. Returns ``[B, L, C]``."""
    B, L, C = x.shape
    W = weight.shape[1]
    acc = _acc_dtype(x)
    prev = conv_state[slots].transpose(1, 2).to(acc) * init[:, None, None].to(acc)  # [B, W-1, C]
    ext = torch.cat([prev, x.to(acc)], dim=1)  # [B, W-1+L, C]: ext[:, W-1+i] = x[:, i]
    w = weight.to(acc).t()  # [W, C]
    out = ext[:, :L] * w[0]
    for j in range(1, W):
        out.addcmul_(ext[:, j:j + L], w[j])
    tail = lens[:, None] + torch.arange(W - 1, device=x.device)[None, :]  # ext rows of the last W-1 inputs
    last = ext.gather(1, tail[:, :, None].expand(B, W - 1, C))  # [B, W-1, C]
    conv_state.index_copy_(0, slots, last.transpose(1, 2).to(conv_state.dtype))
    return F.silu(out).to(x.dtype)


def _conv_window(rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """rows ``[B, C, W-1]`` (the slots' conv states), x ``[B, C]`` -> (the shifted states
    ``[B, C, W-1]`` in rows' dtype, conv + SiLU ``[B, C]`` in x's dtype)."""
    acc = _acc_dtype(x)
    window = torch.cat([rows.to(acc), x[:, :, None].to(acc)], dim=-1)  # [B, C, W]
    return window[:, :, 1:].to(rows.dtype), F.silu((window * weight.to(acc)).sum(-1)).to(x.dtype)


conv_window = _CudaCompiled(_conv_window)  # one fused kernel on CUDA (decode runs it every GDN layer)


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x ``[B, C]`` -> conv + SiLU ``[B, C]``; the states shift by one."""
    rows, out = conv_window(conv_state[slots], x, weight)
    conv_state.index_copy_(0, slots, rows)
    return out


# ---- the gated delta rule ---------------------------------------------------------------------
def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """q, k ``[.., Hk, K]`` -> L2-normalised fp32 ``[.., HV, K]`` (v-head j uses k-head j // (HV / Hk)),
    q scaled by K^-1/2."""
    rep = num_v_heads // q.shape[-2]
    q = _l2norm(q.float()).repeat_interleave(rep, dim=-2) * q.shape[-1] ** -0.5
    return q, _l2norm(k.float()).repeat_interleave(rep, dim=-2)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Reference recurrence over ``[B, L, ...]`` from ``state [B, HV, K, V]`` fp32 (not modified).
    q, k already expanded/normalised ``[B, L, HV, K]`` fp32. Returns (o ``[B, L, HV, V]`` fp32,
    final state). A step with g = 0, beta = 0 and k = 0 leaves the state unchanged (padding)."""
    v = v.float()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        kv = (state * k[:, t, :, :, None]).sum(-2)  # [B, HV, V]: S^T k
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out, state


def _start_states(ssm_state: torch.Tensor, slots: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """``[B, HV, K, V]`` in fp32 (fp64 stays fp64) from the slots' stored states (fp32 or 16-bit,
    ``mamba_ssm_cache_dtype``); zeros where not ``init`` (a prefill from position 0)."""
    start = ssm_state[slots].to(torch.promote_types(ssm_state.dtype, torch.float32))
    return start * init[:, None, None, None].to(start.dtype)


def gated_delta_prefill(q, k, v, g, beta, valid, ssm_state, slots, init) -> torch.Tensor:
    """Torch path (CPU, or CUDA without FLA). Padded sequences ``[B, L, ..]`` (``valid [B, L]``):
    outputs ``[B, L, HV, V]`` fp32; each sequence starts from ``ssm_state[slots[b]]`` (zeros where
    not ``init``) and its final state (at its last valid token) is written back."""
    HV = v.shape[-2]
    qe, ke = _expand_heads(q, k, HV)
    m = valid.to(torch.float32)
    g, beta = g * m[..., None], beta * m[..., None]  # padding: no decay, no write
    ke = ke * m[..., None, None]
    o, final = delta_rule_recurrent(qe, ke, v, g, beta, _start_states(ssm_state, slots, init))
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return o


def gated_delta_decode(q, k, v, g, beta, ssm_state, slots) -> torch.Tensor:
    """One token per sequence (``[B, ..]``): outputs ``[B, HV, V]`` fp32, states updated in place."""
    if q.is_cuda:
        from asyncrl.engine.triton_gdn import gated_delta_decode as triton_decode

        return triton_decode(q, k, v, g, beta, ssm_state, slots)
    qe, ke = _expand_heads(q[:, None], k[:, None], v.shape[-2])
    start = ssm_state[slots].to(torch.promote_types(ssm_state.dtype, torch.float32))
    o, final = delta_rule_recurrent(qe, ke, v[:, None], g[:, None], beta[:, None], start)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return o[:, 0]


# ---- flash-linear-attention (GPU prefill) ---------------------------------------------------------
FLA_CHUNK = 64  # the chunk size of FLA's chunk_gated_delta_rule (its default): fla_chunk_indices is built for it


@functools.lru_cache(maxsize=None)
def _optional(module: str, name: str):
    """``module.name``, or None when the package is absent (CPU installs have no fla-core)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def _fla():
    """FLA's ``chunk_gated_delta_rule``, or None."""
    return _optional("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def _fla_conv():
    """FLA's varlen ``causal_conv1d`` (fla-core 0.6: ``fla.modules.causal_conv1d``), or None."""
    return _optional("fla.modules.causal_conv1d", "causal_conv1d")


def fla_available() -> bool:
    return _fla() is not None


def fla_conv_available() -> bool:
    return _fla_conv() is not None


def fla_chunk_indices(lens: np.ndarray) -> np.ndarray:
    """``[NT, 2]`` int64 (sequence, chunk within it) of every ``FLA_CHUNK``-token chunk of packed
    sequences of lengths ``lens [B]`` (>= 1): FLA's ``prepare_chunk_indices``, built on the host so
    the kernel needs no device->host read of ``cu_seqlens`` (one per layer otherwise)."""
    counts = -(-np.asarray(lens, dtype=np.int64) // FLA_CHUNK)
    seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([seq, np.arange(len(seq), dtype=np.int64) - first], axis=1)


def gated_delta_prefill_packed(q, k, v, g, beta, cu_seqlens, chunk_indices, ssm_state, slots, init) -> torch.Tensor:
    """FLA's chunked kernel over packed tokens: q, k ``[T, Hk, K]``, v ``[T, HV, V]``, g, beta
    ``[T, HV]`` of B sequences (``cu_seqlens [B + 1]`` int64; ``chunk_indices`` from
    ``fla_chunk_indices``; no state crosses sequences) -> o ``[T, HV, V]`` in v's dtype. Initial
    states come from the slots (zeros where not ``init``), final states are written back. All
    inputs are device tensors: no host sync."""
    o, final = _fla()(q[None], k[None], v[None], g[None], beta[None].to(q.dtype), scale=q.shape[-1] ** -0.5,
                      initial_state=_start_states(ssm_state, slots, init), output_final_state=True,
                      use_qk_l2norm_in_kernel=True,
                      cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return o[0]


def causal_conv_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor,
                       conv_state: torch.Tensor, slots: torch.Tensor, init: torch.Tensor,
                       weight: torch.Tensor) -> torch.Tensor:
    """FLA's varlen ``causal_conv1d`` + SiLU over the step's packed tokens: x ``[T, C]`` (may be a
    row-strided view) of B sequences (``cu_seqlens [B + 1]``, ``chunk_indices`` from
    ``fla_chunk_indices``: FLA's 64-token chunks, built on the host), weight ``[C, W]``. Each
    sequence continues from its slot's conv state (zeros where not ``init``) and leaves its last
    W - 1 inputs there. Returns ``[T, C]`` in x's dtype: ``causal_conv_varlen``'s arithmetic
    (fp32 products and sums) in one kernel over the packed tokens, with no ``[B, L, C]`` padding
    and no shifted multiply-adds (a fifth of the 0.8B shape's prefill, bench/RESULTS.md)."""
    prev = conv_state[slots] * init[:, None, None].to(conv_state.dtype)  # [B, C, W-1]
    initial = F.pad(prev, (1, 0)).to(x.dtype)  # FLA's state holds W inputs; its first column is never read
    y, final = _fla_conv()(x[None], weight, initial_state=initial, output_final_state=True, activation="silu",
                           backend="triton", cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    conv_state.index_copy_(0, slots, final[:, :, 1:].to(conv_state.dtype))
    return y[0]
