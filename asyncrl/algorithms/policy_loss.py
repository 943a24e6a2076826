"""Policy-gradient losses: one input record, one config, one registry.

Every loss builds a per-token loss matrix ℓ [b, L] (to be minimised), multiplies it by
the detached off-policy weights ``is_weights`` if given (after clipping, as in verl and
AReaL's decoupled PPO), and aggregates it with ``agg_loss``. r = exp(lp − lp_old) is
the per-token ratio, with lp − lp_old clamped to ±20 so exp() stays finite.

| name          | per-token loss ℓ                                         | paper          |
|---------------|----------------------------------------------------------|----------------|
| ppo_clip      | max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi)), capped at −A·c     | 1707.06347,    |
|               | when A < 0 (dual clip)                                   | 1912.09729     |
| gspo          | same clip on s_it = sg(s_i)·exp(lp − sg(lp)) (GSPO-token) | 2507.18071     |
| gmpo          | −Ā_i·exp(mean_t clip±(lp − lp_old)) per sequence          | 2507.20673     |
| sapo          | −(4/τ)·σ(τ(r − 1))·A, τ = τ_pos if A > 0 else τ_neg        | 2511.20347     |
| cispo         | −sg(clip(r, 1−ε_lo, 1+ε_hi))·A·lp                         | 2506.13585     |
| pg, gpg       | −A·lp                                                    | 2504.02546     |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor

from asyncrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from asyncrl.algorithms.lazy_metrics import LazyMetrics
from asyncrl.algorithms.masked import masked_mean, masked_sum
from asyncrl.algorithms.registry import Registry

MAX_LOG_RATIO = 20.0  # exp(20) ≈ 5e8: large enough never to bind in sane training


@dataclass
class PolicyLossConfig:
    """Hyper-parameters of every policy loss (each reads the ones it needs).

    clip_ratio_low / clip_ratio_high: ε_lo, ε_hi of the clipped ratio (DAPO's clip-higher
        uses 0.2 / 0.28; GSPO uses 3e-4 / 4e-4; for cispo they bound the detached weight,
        verl semantics: clip(r, 1−ε_lo, 1+ε_hi), so TRL's cap 5.0 is ε_hi = 4.0).
    clip_ratio_c: dual-clip bound c (ppo_clip only; Ye et al. 1912.09729). Must be > 1;
        None disables the dual clip.
    tau_pos / tau_neg: SAPO gate temperatures for A > 0 / A ≤ 0.
    loss_agg_mode: one of ``LOSS_AGG_MODES`` (gspo and sapo always use
        seq-mean-token-mean, as in verl).
    loss_scale_factor: L_norm of ``seq-mean-token-sum-norm``; None -> padded length.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} not in {LOSS_AGG_MODES}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None to disable), got {self.clip_ratio_c}")
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError("SAPO temperatures tau_pos and tau_neg must be > 0")


@dataclass
class PolicyLossInput:
    """Shapes [b, L] for one micro-batch.

    logprobs      current policy log-probs of the sampled tokens (requires grad)
    old_logprobs  proximal / old policy log-probs (detached)
    advantages    per-token advantages
    response_mask 1 on tokens that count in the loss
    is_weights    detached off-policy weights (TIS, decoupled PPO behaviour weight, see
                  ``correction.py``), multiplied into ℓ after clipping
    global_tokens / global_seqs: mini-batch counts for exact gradient accumulation
                  (see ``aggregation.py``)
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    is_weights: Optional[Tensor] = None
    global_tokens: Optional[float] = None
    global_seqs: Optional[float] = None

    def mask(self) -> Tensor:
        return self.response_mask.to(self.logprobs.dtype)

    def log_ratio(self) -> Tensor:
        return (self.logprobs - self.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


@dataclass
class PolicyLossOutput:
    """loss: aggregated scalar. metrics (masked token means over the micro-batch):
    clipfrac, clipfrac_lower (dual clip), ppo_kl = mean(lp_old − lp), ratio_mean; a
    ``Mapping[str, float]`` that stays on the device until read (lazy_metrics.py)."""

    loss: Tensor
    metrics: Mapping[str, float]


PolicyLossFn = Callable[[PolicyLossInput, PolicyLossConfig], PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def compute_policy_loss(name: str, inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """Run the loss registered as ``name`` (see ``POLICY_LOSSES.names()``)."""
    return POLICY_LOSSES.get(name)(inp, cfg)


def _finish(
    loss_mat: Tensor,
    inp: PolicyLossInput,
    cfg: PolicyLossConfig,
    ratio: Tensor,
    clipped: Optional[Tensor] = None,
    clipped_lower: Optional[Tensor] = None,
    agg_mode: Optional[str] = None,
) -> PolicyLossOutput:
    """Apply is_weights, aggregate, and compute the shared metrics."""
    mask = inp.mask()
    if inp.is_weights is not None:
        loss_mat = loss_mat * inp.is_weights.detach()
    loss = agg_loss(
        loss_mat,
        mask,
        agg_mode or cfg.loss_agg_mode,
        global_tokens=inp.global_tokens,
        global_seqs=inp.global_seqs,
        norm_length=cfg.loss_scale_factor,
    )
    with torch.no_grad():
        zero = torch.zeros_like(mask)
        stats = torch.stack([
            masked_mean(zero if clipped is None else clipped.to(mask.dtype), mask),
            masked_mean(zero if clipped_lower is None else clipped_lower.to(mask.dtype), mask),
            masked_mean(inp.old_logprobs - inp.logprobs, mask),
            masked_mean(ratio, mask),
        ])  # read lazily: one device sync for all metrics, when (and if) the caller reads them
    keys = ("clipfrac", "clipfrac_lower", "ppo_kl", "ratio_mean")
    return PolicyLossOutput(loss=loss, metrics=LazyMetrics(keys, stats))


@POLICY_LOSSES.register("ppo_clip", "vanilla")
def ppo_clip(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """PPO clipped surrogate (1707.06347) with asymmetric ε and dual clip (1912.09729).

        L1 = −A·r,  L2 = −A·clip(r, 1−ε_lo, 1+ε_hi),  Lc = max(L1, L2)
        ℓ  = min(Lc, −A·c) where A < 0 else Lc

    For A < 0 the loss is capped at |A|·c, so tokens with r > c give zero gradient
    (a stale, very unlikely token cannot blow up the update).
    """
    A = inp.advantages
    ratio = inp.log_ratio().exp()
    unclipped = -A * ratio
    clipped = -A * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss_clip = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if cfg.clip_ratio_c is None:
        return _finish(loss_clip, inp, cfg, ratio, is_clipped)
    dual_bound = -A * cfg.clip_ratio_c
    negative = A < 0
    loss_mat = torch.where(negative, torch.minimum(loss_clip, dual_bound), loss_clip)
    return _finish(loss_mat, inp, cfg, ratio, is_clipped, (loss_clip > dual_bound) & negative)


@POLICY_LOSSES.register("gspo")
def gspo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """GSPO (2507.18071), the GSPO-token form (as in verl):

        log s_i  = Σ_t m·(lp − lp_old) / |o_i|              (geometric-mean ratio)
        log s_it = lp − sg(lp) + sg(log s_i), clamped above at 10
        ℓ        = max(−A·s_it, −A·clip(s_it, 1−ε_lo, 1+ε_hi)),  no dual clip

    s_it equals s_i in value, and its gradient is s_i·∇lp_t, so with a
    sequence-constant A the gradient is the paper's s_i·A_i·(1/|o_i|)·Σ_t ∇lp_t.
    Aggregation is forced to seq-mean-token-mean (the paper's 1/|o_i| and 1/G).
    """
    A, mask = inp.advantages, inp.mask()
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    log_seq_ratio = masked_sum(inp.logprobs - inp.old_logprobs, mask, dim=-1).unsqueeze(-1) / lengths
    log_token_ratio = inp.logprobs - inp.logprobs.detach() + log_seq_ratio.detach()
    ratio = log_token_ratio.clamp(max=10.0).exp()
    unclipped = -A * ratio
    clipped = -A * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    return _finish(loss_mat, inp, cfg, ratio.detach(), clipped > unclipped, agg_mode="seq-mean-token-mean")


@POLICY_LOSSES.register("gmpo", "geo_mean")
def gmpo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """GMPO (2507.20673): geometric mean of token ratios, clipped per token in log space.

        x_t   = lp − lp_old, clipped sign-aware: min(x, ε_hi) if A > 0, max(x, −ε_lo) if A < 0
        ρ_i   = exp(Σ_t m·x_t / |o_i|),   Ā_i = Σ_t m·A / |o_i|
        loss  = mean_i(−Ā_i·ρ_i)          (each valid token carries −Ā_i·ρ_i, seq-mean-token-mean)

    Here ε_lo / ε_hi bound the *log* ratio (the paper uses 0.4, i.e. r in (e^-0.4, e^0.4)).
    Clipped tokens drop out of the gradient; the rest get −Ā_i·ρ_i/|o_i|·∇lp_t. As in
    verl, aggregation is forced to a mean over sequences. ``is_weights`` enter through the
    token mean, i.e. as each sequence's arithmetic-mean weight (verl: geometric mean).
    """
    A, mask = inp.advantages, inp.mask()
    log_ratio = inp.logprobs - inp.old_logprobs
    sign = torch.sign(A)
    clamped = log_ratio.clamp(-cfg.clip_ratio_low, cfg.clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = masked_sum(clipped_log_ratio, mask, dim=-1).unsqueeze(-1) / lengths
    seq_ratio = seq_log_ratio.clamp(max=MAX_LOG_RATIO).exp()
    seq_adv = masked_sum(A, mask, dim=-1).unsqueeze(-1) / lengths
    loss_mat = (-seq_adv * seq_ratio).expand_as(A)
    was_clipped = log_ratio != clamped
    return _finish(loss_mat, inp, cfg, seq_ratio.detach().expand_as(A), was_clipped & (A > 0),
                   was_clipped & (A < 0), agg_mode="seq-mean-token-mean")


@POLICY_LOSSES.register("sapo")
def sapo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """SAPO (2511.20347): a soft, temperature-controlled gate instead of a hard clip.

        τ = τ_pos if A > 0 else τ_neg,   ℓ = −(4/τ)·σ(τ·(r − 1))·A

    ∂ℓ/∂lp = −A·4σ(1−σ)·r: exactly −A (on-policy PG) at r = 1, decaying smoothly as r
    leaves 1, faster for larger τ (τ_neg > τ_pos damps negative updates more). No
    clipping, so clipfrac = 0. Aggregation is forced to seq-mean-token-mean (verl; TRL
    uses the same per-sequence mean).
    """
    A = inp.advantages
    ratio = inp.log_ratio().exp()
    # τ built in the ratio's dtype (as verl's torch.as_tensor(tau, dtype=...)): a float32
    # intermediate would turn 1.05 into 1.0499999523 in a float64 run
    tau = torch.where(A > 0, torch.tensor(cfg.tau_pos, dtype=ratio.dtype, device=ratio.device),
                      torch.tensor(cfg.tau_neg, dtype=ratio.dtype, device=ratio.device))
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return _finish(-gate * A, inp, cfg, ratio, agg_mode="seq-mean-token-mean")


@POLICY_LOSSES.register("cispo")
def cispo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2506.13585): clip the importance weight, not the update.

        ℓ = −sg(clip(r, 1−ε_lo, 1+ε_hi))·A·lp

    Every token keeps a gradient (−w·A·∇lp), only its weight is bounded. ε follows
    verl (a band around 1); TRL's ``epsilon_high`` is an absolute cap instead.
    """
    A = inp.advantages
    ratio = inp.log_ratio().exp()
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    weight = ratio.clamp(low, high).detach()
    is_clipped = (ratio < low) | (ratio > high)
    return _finish(-weight * A * inp.logprobs, inp, cfg, ratio.detach(), is_clipped)


@POLICY_LOSSES.register("pg", "gpg")
def pg(inp: PolicyLossInput, cfg: PolicyLossConfig) -> PolicyLossOutput:
    """Plain policy gradient / REINFORCE (also GPG, 2504.02546): ℓ = −A·lp.

    No ratio, no clipping: correct only on-policy, or with ``is_weights`` carrying
    the off-policy correction (verl's bypass-mode "reinforce").
    """
    ratio = inp.log_ratio().exp().detach()
    return _finish(-inp.advantages * inp.logprobs, inp, cfg, ratio)
