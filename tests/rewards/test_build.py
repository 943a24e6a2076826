"""Config entries to a pool; results to metrics."""
import pytest

from asyncrl.rewards.build import build_reward_pool, reward_metrics, spec_from_config
from asyncrl.rewards.pool import RewardRequest, RewardResult, RewardSpec


def test_spec_from_config_forms():
    assert spec_from_config("math") == RewardSpec("math", "math")
    assert spec_from_config("reward_fixtures:length").name == "length"
    spec = spec_from_config({"fn": "regex", "weight": 0.5, "kwargs": {"pattern": "x"}, "timeout_s": 2})
    assert (spec.name, spec.weight, spec.kwargs, spec.timeout_s) == ("regex", 0.5, {"pattern": "x"}, 2)
    with pytest.raises(ValueError, match="unknown keys \\['wieght'\\]"):
        spec_from_config({"fn": "math", "wieght": 1})
    with pytest.raises(ValueError, match="'fn'"):
        spec_from_config({"name": "x"})


def test_build_pool_and_metrics():
    entries = ["reward_fixtures:length", {"name": "fmt", "fn": "format", "weight": 2.0}]
    with build_reward_pool(entries, mode="inline") as pool:
        results = pool.score([RewardRequest("p", "<think>a</think><answer>b</answer>"), RewardRequest("p", "ab")])
        metrics = reward_metrics(results, pool.stats())
    # lengths 3.4 and 0.2 -> mean 1.8; format 1 and 0 -> mean 0.5; totals 5.4 and 0.2 -> 2.8
    assert metrics["reward/length"] == pytest.approx(1.8)
    assert metrics["reward/fmt"] == pytest.approx(0.5)
    assert metrics["reward/total"] == pytest.approx(2.8)
    assert metrics["reward/failed_fraction"] == 0.0 and metrics["reward/pool_calls"] == 4.0


def test_metrics_count_failed_items():
    results = [RewardResult(0.0, {"a": 0.0}, {"a": "boom"}), RewardResult(1.0, {"a": 1.0})]
    assert reward_metrics(results)["reward/failed_fraction"] == 0.5
    assert reward_metrics([]) == {}
