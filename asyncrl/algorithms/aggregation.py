"""Reducing a per-token loss matrix to one scalar (``loss_agg_mode``).

Notation for one optimizer step (a mini-batch split into micro-batches): ℓ[i,t] is the
per-token loss, m[i,t] the mask, |o_i| = Σ_t m[i,t], M = Σ m over the mini-batch (global
token count), S = number of sequences with |o_i| > 0 (global sequence count).

| mode                      | mini-batch loss                        | used by               |
|---------------------------|----------------------------------------|-----------------------|
| token-mean                | Σ m·ℓ / M                              | DAPO, verl default    |
| seq-mean-token-mean       | Σ_i (Σ_t m·ℓ / |o_i|) / S              | original GRPO         |
| seq-mean-token-sum        | Σ_i Σ_t m·ℓ / S                        |                       |
| seq-mean-token-sum-norm   | Σ_i Σ_t m·ℓ / (S · L_norm)             | Dr. GRPO (2503.20783) |
| token-sum                 | Σ m·ℓ                                  |                       |

Every mode is a sum over rows divided by a mini-batch constant. So when the caller
passes the mini-batch's ``global_tokens`` (M) and ``global_seqs`` (S), each micro-batch
returns its share, and the micro-batch losses SUM exactly to the mini-batch loss:
gradient accumulation is a plain sum of ``.backward()`` calls, no 1/accum factor.
Under data parallelism with gradient averaging over d ranks, pass M and S over all
ranks and multiply the loss by d (verl does the same).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_length: Optional[float] = None,
) -> Tensor:
    """Aggregate ``loss_mat [b, L]`` over ``mask [b, L]`` of one micro-batch to a scalar.

    global_tokens / global_seqs: M and S of the whole mini-batch (see module doc); None
        uses this micro-batch's own counts (then the result is the local mean).
    norm_length: L_norm for ``seq-mean-token-sum-norm`` (Dr. GRPO uses the generation
        budget, e.g. max_response_length); None -> the padded length ``L`` of this
        micro-batch. Pass a constant when micro-batches may be padded differently.
    Empty masks give 0, never NaN.
    """
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(-1)  # [b]
    if mode == "token-mean":
        tokens = float(mask.sum()) if global_tokens is None else global_tokens
        return token_sums.sum() / max(tokens, 1.0)
    if mode == "token-sum":
        return token_sums.sum()
    seqs = float((mask.sum(-1) > 0).sum()) if global_seqs is None else global_seqs
    seqs = max(seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(-1).clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        return token_sums.sum() / seqs / length
    raise ValueError(f"unknown loss_agg_mode {mode!r} (valid: {', '.join(LOSS_AGG_MODES)})")


def global_counts(mask: Tensor) -> tuple[float, float]:
    """(M, S) of a mini-batch mask [B, L]: valid tokens and non-empty sequences.

    Compute once per optimizer step over the whole mini-batch (all-reduce the two
    numbers across ranks under data parallelism), then pass them to every micro-batch.
    """
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())
