"""Reward functions and the pool that runs them.

The contract is a plain function ``fn(prompt, response, **fields) -> float | None``
(see ``registry``); ``RewardPool`` combines weighted rewards and runs them with a
per-call timeout. Importing this package is cheap: math-verify, torch models and the
sandbox load only when their reward is first resolved.
"""
from asyncrl.rewards.build import build_reward_pool, reward_metrics, spec_from_config
from asyncrl.rewards.pool import RewardFailure, RewardPool, RewardRequest, RewardResult, RewardSpec
from asyncrl.rewards.registry import register_reward, registered_names, resolve_reward

__all__ = [
    "RewardFailure", "RewardPool", "RewardRequest", "RewardResult", "RewardSpec",
    "build_reward_pool", "register_reward", "registered_names", "resolve_reward", "reward_metrics",
    "spec_from_config",
]
