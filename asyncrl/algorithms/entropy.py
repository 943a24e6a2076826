"""Token entropy and log-probs from logits.

For a 150k vocabulary never materialise ``[batch, seq, vocab]`` float32 tensors at
once: call these on chunks of positions (see ``chunk_size``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) − Σ_v softmax(z)_v·z_v, ``[..., V] -> [...]``.

    Stable for any logit scale: logsumexp subtracts the max, and softmax·z never forms
    log(0)·0. Divide logits by the sampling temperature first (verl does).
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label], ``logits [..., V], labels [...] -> [...]``, computed as
    z_label − logsumexp(z) so the full log-softmax is never stored."""
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def chunked_logprobs_and_entropy(
    logits: Tensor, labels: Tensor, chunk_size: int = 1024, with_entropy: bool = True
) -> tuple[Tensor, Optional[Tensor]]:
    """``logits [N, V]``, ``labels [N]`` -> (logprobs [N], entropy [N] or None), in float32,
    processing ``chunk_size`` rows at a time so only one chunk is upcast at once."""
    lps, ents = [], []
    for start in range(0, logits.shape[0], chunk_size):
        z = logits[start : start + chunk_size].float()
        lps.append(logprobs_from_logits(z, labels[start : start + chunk_size]))
        if with_entropy:
            ents.append(entropy_from_logits(z))
    lp = torch.cat(lps) if lps else logits.new_zeros(0, dtype=torch.float32)
    if not with_entropy:
        return lp, None
    return lp, torch.cat(ents) if ents else lp.clone()
