"""Off-policy corrections for rollout/training mismatch and asynchronous staleness.

Three policies can be in play for one token:
  π_behav  the rollout engine that sampled it (``rollout_logprobs``; possibly stale in
           async mode, and numerically different from the trainer even when not),
  π_prox   the proximal/old policy, recomputed by the trainer (``old_logprobs``),
  π_θ      the policy being optimised.

TIS (Yao et al., fengyao.notion.site/off-policy-rl) and decoupled PPO (Hilton et al.
arXiv 2110.00641; AReaL) both split the ratio π_θ/π_behav into
    π_θ/π_prox  — PPO-clipped inside the loss (``ppo_clip`` with old_logprobs = lp_prox)
  × π_prox/π_behav — a detached, truncated weight: ``rollout_is_weights`` here.
How the training loop composes them, per micro-batch::

    w, m = rollout_is_weights(old_logprobs, rollout_logprobs, response_mask)
    out  = compute_policy_loss("ppo_clip", PolicyLossInput(lp, old_logprobs, adv,
                               response_mask, is_weights=w, ...), cfg)

With mode="mask" rejected tokens get weight 0 but stay in the denominators (M, S are
counted from the original mask), so rejection does not up-weight the survivors
(AReaL's N_orig).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import Tensor

from asyncrl.algorithms.lazy_metrics import LazyMetrics
from asyncrl.algorithms.masked import masked_mean, masked_sum

MAX_LOG_WEIGHT = 20.0


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    mode: str = "truncate",
    lower_threshold: Optional[float] = None,
) -> tuple[Tensor, Mapping[str, float]]:
    """Importance weights w = π_old/π_rollout, detached, ``[b, L]`` (0 on masked tokens).

    old_logprobs, rollout_logprobs, response_mask: [b, L].
    level "token":     w_t = exp(lp_old_t − lp_roll_t)
    level "sequence":  w_t = exp(Σ_t m·(lp_old − lp_roll)) for every token of the row
    level "geometric": w_t = exp(mean_t m·(lp_old − lp_roll)), the per-token geometric
                       mean: it does not explode with length (AReaL's "mean" for ratios)
    mode "truncate":   w = clamp(w, lower_threshold, threshold)   (TIS; verl's default 2.0)
    mode "mask":       w = 0 outside [lower_threshold, threshold]  (reject; IcePop with a
                       lower bound, e.g. 0.5 / 5.0)
    ``lower_threshold`` None means no lower bound. The log weight is clamped to ±20.

    Metrics: is_weight_mean / is_weight_max (before truncation), is_clipped_frac
    (tokens whose weight was truncated or masked), mismatch_k1 = mean(lp_old − lp_roll),
    mismatch_k3 = mean of the k3 estimate of KL(π_roll‖π_old). They come as a
    ``Mapping[str, float]`` that stays on the device until read (lazy_metrics.py): no sync here.
    """
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    low = 0.0 if lower_threshold is None else lower_threshold
    if not 0.0 <= low <= threshold:
        raise ValueError(f"need 0 <= lower_threshold <= threshold, got {lower_threshold}, {threshold}")
    with torch.no_grad():
        mask = response_mask.to(old_logprobs.dtype)
        log_w = (old_logprobs - rollout_logprobs) * mask
        if level == "sequence":
            log_w = masked_sum(log_w, mask, dim=-1).unsqueeze(-1).expand_as(log_w)
        elif level == "geometric":
            log_w = masked_mean(log_w, mask, dim=-1).unsqueeze(-1).expand_as(log_w)
        raw = log_w.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT).exp() * mask
        outside = ((raw > threshold) | (raw < low)) & (mask > 0)
        if mode == "truncate":
            weights = raw.clamp(min=low, max=threshold)
        else:
            weights = torch.where(outside, torch.zeros_like(raw), raw)
        # k3 of KL(π_roll‖π_old) under samples from π_roll: ρ − 1 − log ρ, ρ = π_old/π_roll.
        log_rho = ((old_logprobs - rollout_logprobs) * mask).clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
        stats = torch.stack([
            masked_mean(raw, mask),
            # raw >= 0 and 0 off the mask: the max over the whole tensor is the masked max (0 when
            # the mask is empty) without a mask.any() sync; only an empty tensor has no max
            (raw * mask).max() if raw.numel() else raw.new_zeros(()),
            masked_mean(outside.to(mask.dtype), mask),
            masked_mean(old_logprobs - rollout_logprobs, mask),
            masked_mean(log_rho.exp() - 1.0 - log_rho, mask),
        ])
    keys = ("is_weight_mean", "is_weight_max", "is_clipped_frac", "mismatch_k1", "mismatch_k3")
    return weights * mask, LazyMetrics(keys, stats)
