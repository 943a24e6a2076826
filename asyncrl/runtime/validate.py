"""Checks of a loaded config against what is registered at run time.

``config`` may not import ``algorithms`` (dependency direction), so the names of
registered estimators and losses are checked here, before anything runs.
"""
from __future__ import annotations

from asyncrl.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from asyncrl.config_schema import ConfigError, closest_key


def check_registered_names(cfg) -> None:
    """Refuse an unknown estimator / loss name, naming the key and the closest valid name."""
    for key, value, registry in (("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATORS),
                                 ("algorithm.policy_loss", cfg.algorithm.policy_loss, POLICY_LOSSES),
                                 ("algorithm.kl_estimator", cfg.algorithm.kl_estimator, KL_ESTIMATORS)):
        names = registry.names()
        if value not in names:
            raise ConfigError(f"{key}: {value!r} is not one of {names}{closest_key(value, names)}")
