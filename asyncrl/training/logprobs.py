"""Per-token log-probs and entropy, computed in chunks, with the prompt computed once per group.

The LM head is applied to at most ``chunk_tokens`` positions at a time, under
activation checkpointing when gradients are needed, so full float32 logits of shape
[batch, seq, vocab] are never held at once (with a 150k vocabulary they would not fit).

GRPO batches hold n responses per prompt. When rows share a prompt, the prompt is run
once per distinct prompt and its KV cache is broadcast to the rows (gradients flow back
through it), so the trainer, like the rollout engine, pays for each prompt once.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so left padding does not shift RoPE. [B, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                   temperature: float, with_entropy: bool):
    """hidden [N, H], targets [N] -> (logprob [N], entropy [N] or empty)."""
    logits = F.linear(hidden, weight, bias).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    if not with_entropy:
        return logprob, logprob.new_zeros(0)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_norm - (probs * logits).sum(-1)
    return logprob, entropy


def _cache_kwarg(base) -> str:
    """The KV-cache argument's name: ``cache`` in recent transformers 5 releases, ``past_key_values``
    before (5.17 still uses the old name, so the major version does not decide it)."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shared_prefix_states(base, input_ids, attention_mask, prompt_length: int, inverse: torch.Tensor):
    """Hidden states predicting each response token [B, L, H], running each distinct
    prompt once: prompt KV [G, ...] is expanded to the B rows by ``inverse`` [B]."""
    groups = int(inverse.max()) + 1
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.zeros(groups, dtype=torch.long, device=inverse.device).scatter_(0, inverse, rows)  # a row per prompt
    prompt_mask = attention_mask[first, :prompt_length]  # one row per distinct prompt (any of its rows)
    prompt_out = base(input_ids=input_ids[first, :prompt_length], attention_mask=prompt_mask,
                      position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache_kwarg = _cache_kwarg(base)
    cache = getattr(prompt_out, cache_kwarg)
    for layer in cache.layers:  # broadcast the prompt's keys/values to its rows (differentiable)
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    positions = position_ids_from_mask(attention_mask)[:, prompt_length:]
    response_hidden = base(input_ids=input_ids[:, prompt_length:], attention_mask=attention_mask,
                           position_ids=positions, use_cache=False, **{cache_kwarg: cache}).last_hidden_state
    last_prompt_state = prompt_out.last_hidden_state[:, -1:, :].index_select(0, inverse)
    return torch.cat([last_prompt_state, response_hidden[:, :-1, :]], dim=1)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                      temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False,
                      share_prompts: bool = True):
    """Log-probs (and entropy) of the response tokens under ``model``.

    Args:
      input_ids, attention_mask: [B, P + L], prompt left-padded to P, response after it.
      prompt_length: P.
      share_prompts: run each distinct prompt once and broadcast its KV (same result).
    Returns:
      logprobs [B, L] (float32) and entropy [B, L] (zeros if ``with_entropy`` is False).
    """
    base, head = model.get_decoder(), model.get_output_embeddings()
    prompts, inverse = torch.unique(input_ids[:, :prompt_length], dim=0, return_inverse=True)
    if share_prompts and prompts.shape[0] < input_ids.shape[0]:
        states = _shared_prefix_states(base, input_ids, attention_mask, prompt_length, inverse)
    else:
        hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        states = hidden[:, prompt_length - 1:-1, :]  # the token at t is predicted by the state at t - 1
    targets = input_ids[:, prompt_length:]
    batch, length, width = states.shape
    flat_states, flat_targets = states.reshape(-1, width), targets.reshape(-1)
    logprobs, entropies = [], []
    needs_grad = torch.is_grad_enabled() and flat_states.requires_grad
    for start in range(0, flat_states.shape[0], chunk_tokens):
        args = (flat_states[start:start + chunk_tokens], head.weight, head.bias,
                flat_targets[start:start + chunk_tokens], temperature, with_entropy)
        if needs_grad:
            lp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        logprobs.append(lp)
        entropies.append(ent)
    logprob = torch.cat(logprobs).view(batch, length)
    entropy = torch.cat(entropies).view(batch, length) if with_entropy else torch.zeros_like(logprob)
    return logprob, entropy
