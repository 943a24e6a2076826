"""Clipped critic loss for PPO (as in verl ``compute_value_loss``; 1707.06347 §3 + OpenAI baselines)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from asyncrl.algorithms.aggregation import agg_loss
from asyncrl.algorithms.masked import masked_mean


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[Tensor, dict[str, float]]:
    """0.5·agg(max((V − R)², (V_clip − R)²)), V_clip = clip(V, V_old − ε_v, V_old + ε_v).

    Shapes [b, L]: values (current critic, with grad), old_values (critic at rollout
    time), returns (GAE targets). Taking the max makes the clip pessimistic: it only
    stops the value from moving far from V_old when that would lower the loss.
    Metrics: vf_clipfrac = mean[(V_clip − R)² > (V − R)²], vpred_mean.

    V_clip is ``clamp(V, V_old − ε, V_old + ε)`` (verl's ``clip_by_value``), which is V itself
    inside the band; ``V_old + clamp(V − V_old, ±ε)`` differs from V by an ulp there and made
    about 1% of in-band tokens count as clipped. ``loss_scale_factor`` is L_norm of
    ``seq-mean-token-sum-norm`` (verl's critic inherits the actor's), None: the padded length.
    """
    clipped = torch.minimum(torch.maximum(values, old_values - cliprange_value), old_values + cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    mask = response_mask.to(values.dtype)
    loss = 0.5 * agg_loss(
        loss_mat, mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
        norm_length=loss_scale_factor,
    )
    with torch.no_grad():
        stats = torch.stack([
            masked_mean((loss_clipped > loss_unclipped).to(mask.dtype), mask),
            masked_mean(values, mask),
        ]).tolist()
    return loss, {"vf_clipfrac": stats[0], "vpred_mean": stats[1]}
