"""From config values to a RewardPool, and from results to metrics.

The runtime's two touch points with rewards:

    pool = build_reward_pool(cfg.reward.rewards, mode=..., num_workers=..., timeout_s=..., default_score=...)
    metrics = reward_metrics(results, pool.stats())   # reward/<name>, reward/total, failures ...

``rewards`` entries are plain config values, so YAML maps onto them directly::

    rewards:
      - math                                   # name = fn = "math", weight 1
      - {fn: format, weight: 0.1}
      - {name: judge, fn: judge, weight: 0.5, kwargs: {base_url: "http://h:8000/v1", model: m}}
"""
from __future__ import annotations

import math
from typing import Any, Sequence, Union

from asyncrl.rewards.pool import RewardPool, RewardResult, RewardSpec

_SPEC_KEYS = {"name", "fn", "weight", "kwargs", "batched", "timeout_s"}


def spec_from_config(entry: Union[str, dict, RewardSpec]) -> RewardSpec:
    """One ``RewardSpec`` from a string (a reward spec) or a dict of its fields."""
    if isinstance(entry, RewardSpec):
        return entry
    if isinstance(entry, str):
        return RewardSpec(name=_default_name(entry), fn=entry)
    if not isinstance(entry, dict) or "fn" not in entry:
        raise ValueError(f"a reward entry is a spec string or a dict with 'fn', got {entry!r}")
    unknown = set(entry) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"reward entry {entry!r}: unknown keys {sorted(unknown)}; allowed: {sorted(_SPEC_KEYS)}")
    values = dict(entry)
    values.setdefault("name", _default_name(values["fn"]))
    values["kwargs"] = dict(values.get("kwargs") or {})
    return RewardSpec(**values)


def _default_name(fn: str) -> str:
    """``"my_pkg.rewards:length_penalty"`` is logged as ``length_penalty``."""
    return fn.rsplit(":", 1)[-1]


def build_reward_pool(entries: Sequence[Union[str, dict, RewardSpec]], **pool_kwargs: Any) -> RewardPool:
    """A ``RewardPool`` over config entries; ``pool_kwargs`` go to its constructor."""
    return RewardPool([spec_from_config(e) for e in entries], **pool_kwargs)


def reward_metrics(results: Sequence[RewardResult], stats: dict[str, Any] | None = None,
                   prefix: str = "reward") -> dict[str, float]:
    """Means per component (``reward/<name>``) and of the total, plus failure rates.

    With ``stats`` (``pool.stats()``, cumulative), also the pool's counters.
    """
    metrics: dict[str, float] = {}
    if results:
        n = len(results)
        metrics[f"{prefix}/total"] = sum(r.total for r in results) / n
        for name in results[0].components:
            metrics[f"{prefix}/{name}"] = sum(r.components[name] for r in results) / n
        metrics[f"{prefix}/failed_fraction"] = sum(bool(r.failed) for r in results) / n
    if stats is not None:
        for key in ("calls", "failures", "timeouts", "nones", "seconds", "worker_restarts"):
            if key in stats:
                metrics[f"{prefix}/pool_{key}"] = float(stats[key])
    return {k: v for k, v in metrics.items() if not math.isnan(v)}
