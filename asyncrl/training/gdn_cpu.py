"""Qwen3.5's token mixer on the CPU, shaped for the trainer's short rows.

transformers' torch functions (the reference, kept: ``hf_kernels.torch_reference``) are written
for long sequences: ``torch_chunk_gated_delta_rule`` pads every row to a multiple of 64 tokens and
solves 64 x 64 triangular systems per chunk, and ``causal_conv1d_fn`` runs ``F.conv1d(groups=C)``,
whose CPU depthwise backward is slow. A GRPO batch of the quickstart is 128 rows of ~18 tokens:
3.5x padding, and the 64 x 64 work (quadratic in the chunk) is ~12x what an 18-token chunk needs.

- :func:`chunk_gated_delta_rule`: transformers' own function with the chunk size cut to the row
  length (one chunk when the row has <= 64 tokens; else the fewest chunks of <= 64 tokens, sized
  evenly so the padding is < one token per chunk). The chunked form is exact for any chunk size
  (the chunk only groups the same recurrence into matmuls), so outputs and gradients equal the
  64-token chunking to fp32 rounding (transformers computes it in fp32 for any input dtype;
  tests/training/test_gdn_cpu.py, 1e-5).
- :func:`causal_conv1d_fn`: the depthwise causal conv of width W as W shifted multiply-adds
  (the engine computes it the same way: ``engine/models/gated_delta.py``), in the weight's dtype.

On one core, one GRPO forward + backward of the 0.87M-parameter tiny Qwen3.5 (128 rows of 18
tokens) takes ~0.35 s instead of ~1.35 s (bench/RESULTS.md, "Model families").
"""
from __future__ import annotations

import inspect

import torch
from transformers.activations import ACT2FN

MAX_CHUNK = 64  # transformers' default chunk: longer rows keep chunks of at most this many tokens


def chunk_size_for(length: int, max_chunk: int = MAX_CHUNK) -> int:
    """Chunk size for a row of ``length`` tokens: ``length`` itself up to ``max_chunk``, else the
    even split into ceil(length / max_chunk) chunks (padding < one token per chunk)."""
    if length <= max_chunk:
        return max(length, 1)
    chunks = -(-length // max_chunk)
    return -(-length // chunks)


def short_row_delta_rule(reference):
    """transformers' ``torch_chunk_gated_delta_rule`` (``reference``: the unwrapped torch function)
    called with :func:`chunk_size_for` the row length. Same arguments and returns: q, k ``[B, T,
    Hk, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]`` -> (o ``[B, T, HV, V]``, final state or None)."""
    accepts = set(inspect.signature(reference).parameters)

    def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = MAX_CHUNK, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in accepts}
        return reference(query, key, value, g=g, beta=beta,
                         chunk_size=chunk_size_for(query.shape[1], chunk_size), **kwargs)

    chunk_gated_delta_rule.__doc__ = short_row_delta_rule.__doc__
    return chunk_gated_delta_rule


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **kwargs) -> torch.Tensor:
    """Depthwise causal conv: hidden_states ``[B, C, T]``, weight ``[C, W]`` -> ``[B, C, T]``
    (``out[:, c, t] = sum_j weight[c, j] * x[:, c, t - W + 1 + j]``, zeros before the row), then
    ``activation``; what transformers' ``causal_conv1d_fn`` computes, without ``F.conv1d``."""
    width, length = weight.shape[-1], hidden_states.shape[-1]
    x = torch.nn.functional.pad(hidden_states.to(weight.dtype), (width - 1, 0))
    out = x[..., :length] * weight[:, :1]
    for j in range(1, width):
        out = out + x[..., j:j + length] * weight[:, j:j + 1]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)
