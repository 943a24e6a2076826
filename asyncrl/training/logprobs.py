"""Per-token log-probs and entropy, computed in chunks.

The LM head is applied to at most ``chunk_tokens`` positions at a time, under
activation checkpointing when gradients are needed, so full float32 logits of shape
[batch, seq, vocab] are never held at once (with a 150k vocabulary they would not fit).
"""
from __future__ import annotations

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


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                      temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False):
    """Log-probs (and entropy) of the response tokens under ``model``.

    Args:
      input_ids, attention_mask: [B, P + L], prompt left-padded to P, response after it.
      prompt_length: P.
    Returns:
      logprobs [B, L] (float32) and entropy [B, L] (zeros if ``with_entropy`` is False).
    """
    base, head = model.get_decoder(), model.get_output_embeddings()
    hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    # The token at position t is predicted by the hidden state at t - 1.
    states = hidden[:, prompt_length - 1:-1, :]
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
