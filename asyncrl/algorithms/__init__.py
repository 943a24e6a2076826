"""Pure, CPU-testable RL algorithms: advantages, policy losses, aggregation, KL, corrections.

Depends on nothing else in asyncrl. Each axis of the algorithm space is a registry keyed
by the config string (``ADV_ESTIMATORS``, ``POLICY_LOSSES``, ``KL_ESTIMATORS``) over one
input record, so every entry has the same signature. See docs/algorithms.md.
"""
from asyncrl.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageInput,
    AdvantageOutput,
    compute_advantages,
)
from asyncrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, global_counts
from asyncrl.algorithms.correction import rollout_is_weights
from asyncrl.algorithms.dapo import filter_groups, overlong_penalty
from asyncrl.algorithms.dpo import dpo_loss
from asyncrl.algorithms.entropy import (
    chunked_logprobs_and_entropy,
    entropy_from_logits,
    logprobs_from_logits,
)
from asyncrl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_in_reward,
    kl_penalty,
)
from asyncrl.algorithms.lazy_metrics import LazyMetrics
from asyncrl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from asyncrl.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
    compute_policy_loss,
)
from asyncrl.algorithms.registry import Registry
from asyncrl.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageInput",
    "AdvantageOutput",
    "FixedKLController",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LazyMetrics",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossInput",
    "PolicyLossOutput",
    "Registry",
    "agg_loss",
    "build_kl_controller",
    "chunked_logprobs_and_entropy",
    "compute_advantages",
    "compute_policy_loss",
    "compute_value_loss",
    "dpo_loss",
    "entropy_from_logits",
    "filter_groups",
    "global_counts",
    "kl_in_reward",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "rollout_is_weights",
]
