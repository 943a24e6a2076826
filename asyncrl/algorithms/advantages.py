"""Advantage estimators: one input record, one registry, one entry point.

Every estimator maps an ``AdvantageInput`` (B responses, padded length L) to
advantages and returns ``[B, L]``, zero on masked tokens, computed without gradient.

Outcome estimators (grpo, rloo, opo, gpg, reinforce_plus_plus_baseline) use one scalar
per response, ``R_i = Σ_t token_rewards[i, t]·mask[i, t]`` (verl's convention), which
equals ``scores`` when ``token_rewards`` is None. Token estimators (gae,
reinforce_plus_plus, remax) scan ``token_rewards`` backwards.

"Dr. GRPO" (arXiv 2503.20783) is ``grpo`` with ``norm_adv_by_std_in_grpo=False``
(pair it with ``loss_agg_mode="seq-mean-token-sum-norm"`` and no KL loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from asyncrl.algorithms.groups import (
    group_index,
    group_mean,
    group_min,
    group_size,
    group_std,
    group_sum,
)
from asyncrl.algorithms.masked import last_token_index, masked_whiten
from asyncrl.algorithms.registry import Registry


@dataclass
class AdvantageInput:
    """Everything any estimator may read. Shapes: B responses, L padded response length.

    scores           [B]    scalar outcome reward per response
    response_mask    [B, L] 1 on valid response tokens
    group_ids        [B]    long; equal id = same prompt
    token_rewards    [B, L] per-token rewards (e.g. score on the last token minus
                            β·KL); None -> ``scores`` on each row's last valid token
    values           [B, L] critic values (gae only)
    baseline_scores  [B]    reward of a greedy rollout of the same prompt (remax only)
    """

    scores: Tensor
    response_mask: Tensor
    group_ids: Tensor
    token_rewards: Optional[Tensor] = None
    values: Optional[Tensor] = None
    baseline_scores: Optional[Tensor] = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6

    def mask(self) -> Tensor:
        """The response mask as floats (the scores' dtype, or the default float dtype
        when scores are integers), so every estimator computes in one dtype."""
        dtype = self.scores.dtype if self.scores.is_floating_point() else torch.get_default_dtype()
        return self.response_mask.to(dtype)

    def rewards(self) -> Tensor:
        """[B, L] per-token rewards, zero on masked tokens."""
        mask = self.mask()
        if self.token_rewards is not None:
            return self.token_rewards.to(mask.dtype) * mask
        rewards = torch.zeros_like(mask)
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, last_token_index(mask)] = self.scores.to(mask.dtype)
        return rewards * mask  # empty rows get no reward

    def outcome(self) -> Tensor:
        """[B] scalar reward per response: Σ_t token_rewards·mask (= scores by default)."""
        if self.token_rewards is None:
            return self.scores.to(self.mask().dtype)
        return self.rewards().sum(-1)


@dataclass
class AdvantageOutput:
    """advantages [B, L] (zero on masked tokens) and returns [B, L] (value targets;
    equal to the advantages for critic-free estimators, reward-to-go for remax)."""

    advantages: Tensor
    returns: Tensor


AdvantageFn = Callable[[AdvantageInput], AdvantageOutput]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def compute_advantages(name: str, inp: AdvantageInput) -> AdvantageOutput:
    """Run the estimator registered as ``name`` (see ``ADV_ESTIMATORS.names()``) without grad."""
    estimator = ADV_ESTIMATORS.get(name)
    _check_shapes(inp)
    with torch.no_grad():
        return estimator(inp)


def _check_shapes(inp: AdvantageInput) -> None:
    B, L = inp.response_mask.shape
    if inp.scores.shape != (B,) or inp.group_ids.shape != (B,):
        raise ValueError(
            f"scores {tuple(inp.scores.shape)} and group_ids {tuple(inp.group_ids.shape)} "
            f"must be [B]={B} for response_mask {(B, L)}"
        )
    for field in ("token_rewards", "values"):
        t = getattr(inp, field)
        if t is not None and t.shape != (B, L):
            raise ValueError(f"{field} {tuple(t.shape)} must be [B, L]={(B, L)}")
    if inp.baseline_scores is not None and inp.baseline_scores.shape != (B,):
        raise ValueError(f"baseline_scores {tuple(inp.baseline_scores.shape)} must be [B]={B}")


def _broadcast(per_row: Tensor, mask: Tensor) -> AdvantageOutput:
    """Sequence-constant advantage [B] -> [B, L] on valid tokens; returns = advantages."""
    adv = per_row.unsqueeze(-1) * mask
    return AdvantageOutput(advantages=adv, returns=adv.clone())


def _reward_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ·G_{t+1} over valid tokens, scanned right to left.

    On masked tokens (e.g. tool observations inside a multi-turn response) the running
    return is carried through unchanged, so it skips them instead of resetting (verl
    2026-08 behaviour). Output is zero on masked tokens.
    """
    if gamma == 1.0:  # undiscounted: a reverse cumulative sum, no Python loop over L
        return (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    running = torch.zeros_like(rewards[:, 0])
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        out[:, t] = running
    return out * mask


@ADV_ESTIMATORS.register("grpo")
def grpo(inp: AdvantageInput) -> AdvantageOutput:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (R_i − μ_g) / (σ_g + ε).

    σ_g is the unbiased (n−1) std, as in verl and TRL. A singleton group has no
    baseline: A_i = R_i exactly (verl gives R_i/(1+ε)). With
    ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO): A_i = R_i − μ_g.
    """
    R, mask = inp.outcome(), inp.mask()
    n = group_size(inp.group_ids, R.dtype)
    singleton = n <= 1
    centred = torch.where(singleton, R, R - group_mean(R, inp.group_ids))
    if inp.norm_adv_by_std_in_grpo:
        denom = torch.where(singleton, torch.ones_like(R), group_std(R, inp.group_ids) + inp.epsilon)
        centred = centred / denom
    return _broadcast(centred, mask)


@ADV_ESTIMATORS.register("rloo")
def rloo(inp: AdvantageInput) -> AdvantageOutput:
    """RLOO (arXiv 2402.14740): A_i = R_i − mean_{j≠i} R_j = n/(n−1)·(R_i − μ_g).

    A singleton group has no other sample, so its baseline is 0 and A_i = R_i (verl's
    loop version; ``rloo_vectorized`` gives 0 instead). Consistent with grpo.
    """
    R, mask = inp.outcome(), inp.mask()
    n = group_size(inp.group_ids, R.dtype)
    # the scaled form (not Σ_{j≠i} R_j/(n−1)) keeps constant groups at exactly 0
    loo = n / (n - 1).clamp(min=1) * (R - group_mean(R, inp.group_ids))
    adv = torch.where(n > 1, loo, R)
    return _broadcast(adv, mask)


@ADV_ESTIMATORS.register("grpo_passk")
def grpo_passk(inp: AdvantageInput) -> AdvantageOutput:
    """Pass@k GRPO (verl ``grpo_passk``, after arXiv 2503.19595): only the best response
    of each group is credited, with A = R_max − R_second (÷ (σ_g + ε) when
    ``norm_adv_by_std_in_grpo``); every other response gets 0. This optimises the
    best-of-n reward. Ties give 0 (the first maximum is credited). Groups need n ≥ 2.
    """
    R, mask = inp.outcome(), inp.mask()
    adv = torch.zeros_like(R)
    inverse, n_groups = group_index(inp.group_ids)
    std = group_std(R, inp.group_ids)
    for g in range(n_groups):
        rows = (inverse == g).nonzero().squeeze(-1)
        if rows.numel() < 2:
            raise ValueError("grpo_passk needs at least 2 responses per prompt")
        top = torch.topk(R[rows], 2)
        best = rows[top.indices[0]]
        adv[best] = top.values[0] - top.values[1]
        if inp.norm_adv_by_std_in_grpo:
            adv[best] = adv[best] / (std[best] + inp.epsilon)
    return _broadcast(adv, mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(inp: AdvantageInput) -> AdvantageOutput:
    """REINFORCE++ (arXiv 2501.03262): G_t = r_t + γ·G_{t+1}; A = whiten(G) over all
    valid tokens of the batch. Use with KL in the reward (``token_rewards``).
    returns = G (before whitening)."""
    mask = inp.mask()
    returns = _reward_to_go(inp.rewards(), mask, inp.gamma)
    adv = masked_whiten(returns, mask) * mask
    return AdvantageOutput(advantages=adv, returns=returns)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inp: AdvantageInput) -> AdvantageOutput:
    """REINFORCE++-baseline: (R_i − μ_g) broadcast to tokens, then whitened over all
    valid tokens of the batch (token-weighted: long responses weigh more). Singleton
    groups have μ = 0."""
    R, mask = inp.outcome(), inp.mask()
    n = group_size(inp.group_ids, R.dtype)
    centred = torch.where(n > 1, R - group_mean(R, inp.group_ids), R)
    tokens = centred.unsqueeze(-1) * mask
    adv = masked_whiten(tokens, mask) * mask
    return AdvantageOutput(advantages=adv, returns=adv.clone())


@ADV_ESTIMATORS.register("remax")
def remax(inp: AdvantageInput) -> AdvantageOutput:
    """ReMax (arXiv 2310.10505): A_t = Σ_{t'≥t} γ^{t'-t} r_{t'} − b_i, with b_i the
    reward of a greedy rollout of the same prompt (``baseline_scores``). returns = G."""
    if inp.baseline_scores is None:
        raise ValueError("remax needs baseline_scores (reward of a greedy rollout per row)")
    mask = inp.mask()
    returns = _reward_to_go(inp.rewards(), mask, inp.gamma)
    adv = (returns - inp.baseline_scores.to(mask.dtype).unsqueeze(-1)) * mask
    return AdvantageOutput(advantages=adv, returns=returns)


@ADV_ESTIMATORS.register("gae")
def gae(inp: AdvantageInput) -> AdvantageOutput:
    """GAE (arXiv 1506.02438), PPO's estimator. Right-to-left over valid tokens:
        δ_t = r_t + γ·V_{t+1} − V_t,   Â_t = δ_t + γλ·Â_{t+1}
    where V_{t+1}, Â_{t+1} are those of the next *valid* token (masked observation
    tokens are skipped; 0 past the end). returns = Â + V, taken before the advantages
    are whitened over all valid tokens of the batch.
    """
    if inp.values is None:
        raise ValueError("gae needs values [B, L] from the critic")
    mask = inp.mask()
    rewards, values = inp.rewards(), inp.values.to(mask.dtype) * mask
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + inp.gamma * next_value - values[:, t]
        adv_t = delta + inp.gamma * inp.lam * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        adv[:, t] = next_adv
    returns = (adv + values) * mask
    return AdvantageOutput(advantages=masked_whiten(adv, mask) * mask, returns=returns)


@ADV_ESTIMATORS.register("opo")
def opo(inp: AdvantageInput) -> AdvantageOutput:
    """OPO (arXiv 2505.23585, optimal reward baseline): length-weighted group baseline
    b_g = Σ_j |o_j|·R_j / Σ_j |o_j|;  A_i = R_i − b_g.

    A one-sample group has no baseline (b = 0, A = R), as in verl's
    ``compute_opo_outcome_advantage`` and this package's other outcome estimators."""
    R, mask = inp.outcome(), inp.mask()
    lengths = mask.sum(-1)
    total_len = group_sum(lengths, inp.group_ids)
    shift = group_min(R, inp.group_ids)  # exact baseline for constant groups (see group_mean)
    baseline = shift + group_sum(lengths * (R - shift), inp.group_ids) / total_len.clamp(min=1)
    baseline = torch.where(group_size(inp.group_ids, R.dtype) > 1, baseline, torch.zeros_like(baseline))
    return _broadcast(R - baseline, mask)


@ADV_ESTIMATORS.register("gpg")
def gpg(inp: AdvantageInput) -> AdvantageOutput:
    """GPG (arXiv 2504.02546): A_i = α·(R_i − μ_g), α = B / max(1, #{i: R_i ≠ 0}).

    α rescales so that batches with few non-zero rewards still give a full-size
    gradient. Pair with ``policy_loss="gpg"`` (−A·logπ, no ratio)."""
    R, mask = inp.outcome(), inp.mask()
    alpha = R.shape[0] / max(1, int((R != 0).sum()))
    n = group_size(inp.group_ids, R.dtype)
    centred = torch.where(n > 1, R - group_mean(R, inp.group_ids), R)
    return _broadcast(alpha * centred, mask)
