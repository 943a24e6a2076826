"""Gated DeltaNet ops over per-sequence state slots: the causal conv and the gated delta rule.

Every op reads the state of slot ``slots[b]`` for sequence b (or zeros where ``init[b]`` is
False: a prefill from position 0) and writes the new state back in place, so a sequence's
state lives in one slot of the ``StatePool`` for its whole life.

Kernels: on CUDA, prefill uses flash-linear-attention's ``chunk_gated_delta_rule`` (varlen via
``cu_seqlens``, the library made for it; ``pip install fla-core``) and decode our Triton
kernel ``triton_gdn.gated_delta_decode_kernel`` (one token, state read and written in place
through the slot ids: CUDA-graph capturable; FLA's recurrent kernel takes no slot ids). On CPU
(or without FLA) the pure-torch recurrence below runs; the tests check it against
transformers' own torch functions.

Shapes: q, k ``[.., Hk, K]``, v ``[.., HV, V]``, g (log-decay) and beta ``[.., HV]`` fp32;
state ``[slots, HV, K, V]`` fp32; conv state ``[slots, C, kernel - 1]``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


# ---- the short causal convolution -------------------------------------------------------------
def causal_conv_varlen(x: torch.Tensor, lens: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                       init: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over padded sequences, continuing from their conv states.

    x ``[B, L, C]`` (row b real for its first ``lens[b]`` tokens), weight ``[C, W]``. The W - 1
    inputs before each sequence come from ``conv_state[slots[b]]`` (zeros where not ``init``);
    the state is then set to the last W - 1 inputs up to ``lens[b]``. Returns ``[B, L, C]``."""
    B, L, C = x.shape
    W = weight.shape[1]
    prev = conv_state[slots].to(x.dtype) * init[:, None, None].to(x.dtype)  # [B, C, W-1]
    ext = torch.cat([prev, x.transpose(1, 2)], dim=-1)  # [B, C, W-1+L]
    out = F.silu(F.conv1d(ext.to(weight.dtype), weight.unsqueeze(1), groups=C))  # [B, C, L]
    tail = lens[:, None] + torch.arange(W - 1, device=x.device)[None, :]  # ext index of the last W-1 inputs
    conv_state.index_copy_(0, slots, ext.gather(2, tail[:, None, :].expand(B, C, W - 1)).to(conv_state.dtype))
    return out.transpose(1, 2).to(x.dtype)


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x ``[B, C]`` -> conv + SiLU ``[B, C]``; the states shift by one."""
    window = torch.cat([conv_state[slots].to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, W]
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)


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


def gated_delta_prefill(q, k, v, g, beta, valid, ssm_state, slots, init) -> torch.Tensor:
    """Padded sequences ``[B, L, ..]`` (``valid [B, L]``): outputs ``[B, L, HV, V]`` fp32; each
    sequence starts from ``ssm_state[slots[b]]`` (zeros where not ``init``) and its final state
    (at its last valid token) is written back."""
    HV = v.shape[-2]
    if q.is_cuda and _fla() is not None:
        return _prefill_fla(q, k, v, g, beta, valid, ssm_state, slots, init)
    qe, ke = _expand_heads(q, k, HV)
    m = valid.to(torch.float32)
    g, beta = g * m[..., None], beta * m[..., None]  # padding: no decay, no write
    ke = ke * m[..., None, None]
    start = ssm_state[slots] * init[:, None, None, None].to(ssm_state.dtype)
    o, final = delta_rule_recurrent(qe, ke, v, g, beta, start)
    ssm_state.index_copy_(0, slots, final)
    return o


def gated_delta_decode(q, k, v, g, beta, ssm_state, slots) -> torch.Tensor:
    """One token per sequence (``[B, ..]``): outputs ``[B, HV, V]`` fp32, states updated in place."""
    if q.is_cuda:
        from asyncrl.engine.triton_gdn import gated_delta_decode as triton_decode

        return triton_decode(q, k, v, g, beta, ssm_state, slots)
    qe, ke = _expand_heads(q[:, None], k[:, None], v.shape[-2])
    o, final = delta_rule_recurrent(qe, ke, v[:, None], g[:, None], beta[:, None], ssm_state[slots])
    ssm_state.index_copy_(0, slots, final)
    return o[:, 0]


# ---- flash-linear-attention (GPU prefill) ---------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _fla():
    """FLA's ``chunk_gated_delta_rule``, or None when the package is absent (CPU installs)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _prefill_fla(q, k, v, g, beta, valid, ssm_state, slots, init) -> torch.Tensor:
    """FLA's chunked kernel on the packed valid tokens (B = 1 + ``cu_seqlens``: no state
    crosses sequences), initial states from the slots, final states written back."""
    B, L = valid.shape
    lens = valid.sum(1)
    cu = F.pad(lens.cumsum(0), (1, 0))
    flat = valid.reshape(-1)
    pack = lambda t: t.reshape(B * L, *t.shape[2:])[flat][None]  # noqa: E731
    start = ssm_state[slots] * init[:, None, None, None].to(ssm_state.dtype)
    o, final = _fla()(pack(q), pack(k), pack(v), pack(g), pack(beta).to(q.dtype), scale=q.shape[-1] ** -0.5,
                      initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    out = o.new_zeros(B * L, *o.shape[2:])
    out[flat] = o[0]
    return out.reshape(B, L, *o.shape[2:]).float()
