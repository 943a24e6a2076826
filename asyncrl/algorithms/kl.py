"""Per-token KL estimators and the KL coefficient controllers.

Estimators follow Schulman, "Approximating KL divergence" (joschu.net/blog/kl-approx.html).
With x = lp − lp_ref (samples drawn from the current policy π):

| name              | value                                  | note                         |
|-------------------|----------------------------------------|------------------------------|
| k1, kl            | x                                      | unbiased, high variance      |
| abs               | |x|                                    |                              |
| k2, mse           | ½·x²                                   | biased, low variance         |
| k3, low_var_kl    | e^{−x} + x − 1, −x clamped to ±20,     | unbiased, ≥ 0 (verl's clamp) |
|                   | result clamped to [−10, 10]            |                              |
| <name>+           | value of <name>, gradient of k2        | straight-through             |

Why "+": as a *loss* term, the gradient of k1 is ∇lp, whose expectation under π is zero,
and k3's gradient is biased; k2's gradient x·∇lp is the one that actually descends
KL(π‖π_ref). ``k3+`` reports k3's value but trains with k2's gradient.
"""
from __future__ import annotations

from typing import Callable, Union

import torch
from torch import Tensor

from asyncrl.algorithms.masked import last_token_index, masked_mean
from asyncrl.algorithms.registry import Registry

KLFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("kl estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (logprobs - ref_logprobs).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # The clamps keep exp() finite when the policies disagree wildly (verl's bounds).
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (d.exp() - d - 1.0).clamp(-10.0, 10.0)


def _straight_through(base: KLFn) -> KLFn:
    def estimator(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        k2 = kl_k2(logprobs, ref_logprobs)
        return k2 - k2.detach() + base(logprobs, ref_logprobs).detach()

    estimator.__doc__ = f"Value of {base.__name__}, gradient of k2 (straight-through)."
    return estimator


for _name in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
    KL_ESTIMATORS.register(_name + "+")(_straight_through(KL_ESTIMATORS.get(_name)))
del _name


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate ``[b, L]`` of KL(π‖π_ref) from log-probs of the sampled tokens.

    logprobs [b, L] under the policy being penalised (current, for a KL loss; old, for
    KL in the reward), ref_logprobs [b, L] under the reference. ``estimator`` is one of
    ``KL_ESTIMATORS.names()``. Masking and aggregation are the caller's job.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


def kl_in_reward(
    scores: Tensor,
    response_mask: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, float]:
    """Token rewards with the KL penalty folded in (PPO / REINFORCE++ / RLOO style).

        token_rewards[i, t] = scores_i·[t = last valid token of i] − β·kl(lp_old, lp_ref)[i, t]·m

    scores [B], response_mask / old_logprobs / ref_logprobs [B, L]. Uses the *old*
    policy's log-probs and no gradient (the penalty is part of the reward, not the
    loss). Returns (token_rewards [B, L], current_kl), current_kl being the batch mean
    of each sequence's token-mean KL: feed it to the controller's ``update``.
    """
    with torch.no_grad():
        mask = response_mask.to(old_logprobs.dtype)
        kl = kl_penalty(old_logprobs, ref_logprobs, estimator) * mask
        rewards = torch.zeros_like(mask)
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, last_token_index(mask)] = scores.to(mask.dtype)
        token_rewards = (rewards - kl_coef * kl) * mask
        current_kl = masked_mean(kl, mask, dim=-1).mean()
    return token_rewards, float(current_kl)


class FixedKLController:
    """Constant KL coefficient β."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same interface as the adaptive controller)."""


class AdaptiveKLController:
    """Ziegler et al. (arXiv 1909.08593) proportional controller driving KL to a target:

        e = clip(current_kl / target_kl − 1, −0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)

    n_steps is the number of sequences in the batch (verl's convention).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = Union[FixedKLController, AdaptiveKLController]


def build_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> KLController:
    """``type`` "fixed" or "adaptive"; defaults are verl's ``algorithm.kl_ctrl``."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller type {type!r} (valid: 'fixed', 'adaptive')")
