"""Token entropy and log-probs from logits.

For a 150k vocabulary never materialise ``[batch, seq, vocab]`` float32 tensors at
once: ``chunked_logprobs_and_entropy`` processes positions in chunks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


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


def _chunk_stats(logits: Tensor, labels: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
    z = logits.float()
    lp = logprobs_from_logits(z, labels)
    return lp, entropy_from_logits(z) if with_entropy else torch.zeros_like(lp)


def chunked_logprobs_and_entropy(
    logits: Tensor, labels: Tensor, chunk_size: int = 1024, with_entropy: bool = True
) -> tuple[Tensor, Optional[Tensor]]:
    """``logits [N, V]`` (any float dtype), ``labels [N]`` -> (logprobs [N], entropy [N]
    or None) in float32, ``chunk_size`` rows at a time.

    Peak extra memory is one chunk's float32 copy (chunk_size × V), not N × V. Under
    autograd each chunk is checkpointed: backward recomputes the float32 softmax from
    the original logits instead of keeping every chunk's copy alive.
    """
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    lps, ents = [], []
    for start in range(0, logits.shape[0], chunk_size):
        chunk, chunk_labels = logits[start : start + chunk_size], labels[start : start + chunk_size]
        if use_checkpoint:
            lp, ent = checkpoint(_chunk_stats, chunk, chunk_labels, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(chunk, chunk_labels, with_entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
