"""Each health monitor: a healthy synthetic stream in which nothing fires, and a stream driven
into that monitor's failure in which its warning (and only its warning) fires."""
from __future__ import annotations

import io
import json
import math
import random

import pytest
from rich.console import Console

from asyncrl.metrics.health import (MONITORS, HealthConfig, HealthMonitor, SampleStats,
                                    length_reward_correlation, read_events, replay)

STEPS, BREAK = 60, 30  # failures start at step BREAK


def healthy_row(step: int, rng: random.Random) -> dict:
    """Every metric the monitors read, at healthy values with a little noise."""
    row = {
        "reward/mean": 0.3 + 0.004 * step + rng.uniform(-0.02, 0.02),
        "kl/ref": 0.01 + 0.0002 * step,
        "async/staleness_violations": 0.0,
        "async/version_lag": float(rng.choice([0, 1])),
        "throughput/rollout_tokens_per_s": 1000.0 * rng.uniform(0.9, 1.1),
        "engine/prefix_cache_hit_rate": 0.8 + rng.uniform(-0.03, 0.03),
        "groups/degenerate_fraction": rng.uniform(0.1, 0.5),
        "actor/entropy": 1.2 - 0.005 * step,
        "actor/skipped_step": 0.0,
        "actor/pg_loss": rng.uniform(-0.1, 0.1),
        "actor/grad_norm": rng.uniform(0.5, 2.0),
        "rollout/logprob_gap": rng.uniform(0.005, 0.02),
        "async/rollout_restarts": 0.0,
    }
    if step % 5 == 0:
        row["eval/accuracy"] = 0.4 + 0.004 * step + rng.uniform(-0.01, 0.01)
    return row


def healthy_samples(rng: random.Random, groups: int = 8, n: int = 4) -> SampleStats:
    """Lengths and 0/1 rewards drawn independently: no length-reward correlation."""
    return SampleStats(lengths=[rng.randint(5, 50) for _ in range(groups * n)],
                       rewards=[float(rng.random() < 0.5) for _ in range(groups * n)],
                       group_ids=[g for g in range(groups) for _ in range(n)])


def length_hacked_samples(rng: random.Random, groups: int = 8, n: int = 4) -> SampleStats:
    """Within each group the longer answers score higher."""
    lengths = [rng.randint(5, 50) for _ in range(groups * n)]
    return SampleStats(lengths=lengths, rewards=[1.0 if x > 27 else 0.0 for x in lengths],
                       group_ids=[g for g in range(groups) for _ in range(n)])


def drive(break_row=None, break_samples=None, cfg: HealthConfig | None = None):
    """Run STEPS synthetic steps; from step BREAK on, ``break_row`` mutates the row."""
    rng = random.Random(0)
    monitor = HealthMonitor(cfg or HealthConfig())
    for step in range(1, STEPS + 1):
        row = healthy_row(step, rng)
        samples = healthy_samples(rng)
        if step >= BREAK and break_row is not None:
            break_row(row, step)
        if step >= BREAK and break_samples is not None:
            samples = break_samples(rng)
        monitor.observe(step, row, samples)
    return monitor


def test_healthy_stream_fires_nothing():
    monitor = drive()
    assert monitor.events == []
    metrics = monitor.step_metrics()
    for cls in MONITORS:  # every monitor saw its input and reports 0
        assert metrics[f"health/{cls.name}"] == 0.0, cls.name
        assert metrics[f"health/{cls.name}_count"] == 0.0
    assert metrics["health/events_total"] == 0.0
    assert metrics["health/kl_budget_used"] == pytest.approx((0.01 + 0.0002 * STEPS) / 0.1)
    assert abs(metrics["reward/length_corr"]) < 0.3


def _set(**values):
    def mutate(row, step):
        row.update(values)
    return mutate


def _hacking(row, step):
    row["reward/mean"] = 0.5 + 0.02 * (step - BREAK)  # reward keeps climbing...
    if "eval/accuracy" in row:
        row["eval/accuracy"] = 0.5 - 0.01 * (step - BREAK)  # ...held-out accuracy falls


def _nonfinite(row, step):
    if step == 40:
        row.update({"actor/skipped_step": 1.0, "actor/nonfinite_loss": 0.25, "actor/grad_norm": math.nan})


FAILURES = {
    "kl_budget": _set(**{"kl/ref": 0.5}),
    "reward_hacking": _hacking,
    "staleness": lambda row, step: row.update({"async/staleness_violations": 3.0} if step == 40 else {}),
    "version_lag": _set(**{"async/version_lag": 5.0}),
    "throughput_drop": _set(**{"throughput/rollout_tokens_per_s": 300.0}),
    "prefix_cache_drop": _set(**{"engine/prefix_cache_hit_rate": 0.2}),
    "degenerate_groups": _set(**{"groups/degenerate_fraction": 0.97}),
    "entropy_collapse": _set(**{"actor/entropy": 0.01}),
    "entropy_blowup": _set(**{"actor/entropy": 5.0}),
    "nonfinite": _nonfinite,
    "logprob_gap": _set(**{"rollout/logprob_gap": 0.5}),
    "rollout_restarts": lambda row, step: row.update({"async/rollout_restarts": 1.0 if step >= 40 else 0.0}),
}


def test_every_monitor_has_a_failure_test():
    assert set(FAILURES) | {"length_hacking"} == {cls.name for cls in MONITORS}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_failure_fires_its_monitor_only(name):
    monitor = drive(break_row=FAILURES[name])
    fired = {e.monitor for e in monitor.events}
    assert fired == {name}
    first = min(e.step for e in monitor.events)
    assert BREAK <= first <= BREAK + 10  # fires soon after the failure starts
    assert monitor.counts[name] >= 1


def test_length_hacking_fires_from_samples():
    monitor = drive(break_samples=length_hacked_samples)
    assert {e.monitor for e in monitor.events} == {"length_hacking"}
    assert monitor.step_metrics()["reward/length_corr"] > 0.5


def test_length_hacking_reads_a_correlation_metric():
    monitor = HealthMonitor(HealthConfig())
    assert monitor.observe(1, {"reward/length_corr": 0.2}) == []
    events = monitor.observe(2, {"reward/length_corr": 0.8})
    assert [e.monitor for e in events] == ["length_hacking"]


def test_nonfinite_counts_each_skipped_step():
    monitor = HealthMonitor(HealthConfig())
    for step in range(1, 6):
        monitor.observe(step, {"actor/skipped_step": float(step % 2), "actor/pg_loss": 0.1})
    assert monitor.counts["nonfinite"] == 3  # steps 1, 3, 5
    assert monitor.step_metrics()["health/nonfinite_count"] == 3.0


def test_nan_string_from_jsonl_counts_as_nonfinite():
    monitor = HealthMonitor(HealthConfig())
    events = monitor.observe(1, {"actor/pg_loss": "nan"})  # the JSONL sink writes NaN as "nan"
    assert [e.monitor for e in events] == ["nonfinite"]


def test_absent_inputs_keep_monitors_silent_and_unreported():
    monitor = HealthMonitor(HealthConfig())
    monitor.observe(1, {"reward/mean": 0.5})  # synchronous run without a reference model
    metrics = monitor.step_metrics()
    assert "health/kl_budget" not in metrics and "health/staleness" not in metrics
    assert metrics["health/events_total"] == 0.0


def test_disabled_config_fires_nothing():
    monitor = drive(break_row=FAILURES["kl_budget"], cfg=HealthConfig(enabled=False))
    assert monitor.events == []


def test_events_are_logged_and_read_back(tmp_path):
    path = tmp_path / "health_events.jsonl"
    monitor = HealthMonitor(HealthConfig(), events_path=path)
    monitor.observe(1, {"kl/ref": 0.3})
    monitor.observe(2, {"kl/ref": math.inf})
    events = read_events(path)
    assert [(e.step, e.monitor) for e in events] == [(1, "kl_budget"), (2, "kl_budget")]
    assert events[0].value == pytest.approx(0.3) and math.isinf(events[1].value)


def test_an_episode_is_printed_once_when_it_starts_and_once_when_it_ends():
    out = io.StringIO()
    console = Console(file=out, width=300)
    monitor = HealthMonitor(HealthConfig())
    printed = []
    kl = {**{s: 0.5 for s in range(1, 16)}, 13: 0.9, 16: 0.01, 17: 0.01, 18: 0.4, 19: 0.4}
    for step in range(1, 20):  # steps 1-15 over budget (worst 0.9 at 13), 16-17 fine, 18-19 over again
        printed += monitor.warn(monitor.observe(step, {"kl/ref": kl[step]}), console)
    assert [e.step for e in printed] == [1, 18]  # two episodes, each printed once at its start
    text = out.getvalue()
    assert text.count("exceeds the budget") == 2
    assert "kl_budget fired 15 step(s), steps 1-15, worst 0.9 (threshold 0.1); quiet from step 16" in text
    [still] = monitor.finish(console)
    assert (still.first, still.last, still.count) == (18, 19, 2)
    assert "fired 2 step(s), steps 18-19, worst 0.4" in out.getvalue() and "still firing" in out.getvalue()
    [row] = monitor.summary()["monitors"]
    assert (row["first"], row["last"], row["steps"], row["episodes"], row["worst"]) == (1, 19, 17, 2, 0.9)


def test_repeat_every_reprints_a_long_episode_with_its_count():
    out = io.StringIO()
    monitor = HealthMonitor(HealthConfig(repeat_every=10))
    printed = []
    for step in range(1, 16):
        printed += monitor.warn(monitor.observe(step, {"kl/ref": 0.5}), Console(file=out, width=300))
    assert [e.step for e in printed] == [1, 11]
    assert "(firing for 11 steps)" in out.getvalue()


def test_a_step_without_the_monitors_input_does_not_end_its_episode():
    """reward_hacking reads eval/accuracy, present on eval steps only: the steps between two
    evals neither continue nor end an episode."""
    monitor = HealthMonitor(HealthConfig(window=1, hacking_patience=1))
    monitor.observe(1, {"reward/mean": 0.2, "eval/accuracy": 0.6})
    for step in range(2, 8):
        row = {"reward/mean": 0.5 + step / 10}
        if step in (3, 6):
            row["eval/accuracy"] = 0.4  # fired at both evals
        monitor.observe(step, row)
    [episode] = monitor.episodes()
    assert (episode.first, episode.last, episode.count) == (3, 6, 2) and monitor.open


def test_logprob_gap_knows_the_run_mode():
    """Async: rollout/logprob_gap carries the expected one-version lag, so the monitor reads the
    weight-sync probe (same weights on both sides); a large probe gap still fires."""
    lagged = {"rollout/logprob_gap": 0.5, "weight_sync/probe_gap": 1e-4}
    assert HealthMonitor(HealthConfig(), mode="sync").observe(1, lagged)[0].monitor == "logprob_gap"
    async_monitor = HealthMonitor(HealthConfig(), mode="async")
    assert async_monitor.observe(1, lagged) == []
    [event] = async_monitor.observe(2, {**lagged, "weight_sync/probe_gap": 0.3})
    assert event.monitor == "logprob_gap" and "weight_sync/probe_gap" in event.message


def test_length_reward_correlation_hand_values():
    assert length_reward_correlation([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    assert length_reward_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert length_reward_correlation([1, 2, 3], [1, 1, 1]) is None
    # Two prompts: the long-answer prompt is hard (low reward), so pooled r < 0, yet within each
    # prompt the longer answer scores higher: centred values are x = (-1, 1, -1, 1) and
    # y = (-0.5, 0.5, -0.5, 0.5), so the within-group r is exactly +1.
    lengths, rewards, groups = [10, 12, 50, 52], [0.5, 1.5, 0.0, 1.0], [0, 0, 1, 1]
    assert length_reward_correlation(lengths, rewards) < 0
    assert length_reward_correlation(lengths, rewards, groups) == pytest.approx(1.0)


def test_sample_stats_from_batch():
    torch = pytest.importorskip("torch")

    class Batch:
        response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        scores = torch.tensor([0.0, 1.0])
        group_ids = torch.tensor([0, 0])

    stats = SampleStats.from_batch(Batch())
    assert stats.lengths == [2, 3] and stats.rewards == [0.0, 1.0] and stats.group_ids == [0, 0]


def test_replay_of_logged_rows_matches_live_monitoring():
    rng = random.Random(1)
    rows = []
    for step in range(1, 41):
        row = {"step": step, **healthy_row(step, rng)}
        if step >= BREAK:
            row["kl/ref"] = 0.5
        rows.append(row)
    live = HealthMonitor(HealthConfig())
    for row in rows:
        live.observe(row["step"], row)
    replayed = replay(rows)
    assert [(e.step, e.monitor) for e in replayed.events] == [(e.step, e.monitor) for e in live.events]
    assert {e.monitor for e in replayed.events} == {"kl_budget"}


def test_health_config_loads_strictly_from_a_dict():
    from asyncrl.config_schema import ConfigError, build_dataclass

    cfg = build_dataclass(HealthConfig, {"kl_budget": 0.2, "window": 3}, "health")
    assert cfg.kl_budget == 0.2 and cfg.window == 3 and cfg.degenerate_max == 0.9
    with pytest.raises(ConfigError, match="health.kl_budget"):
        build_dataclass(HealthConfig, {"kl_budget": -1.0}, "health")


def test_summary_counts_firings_per_monitor():
    monitor = drive(break_row=FAILURES["version_lag"])
    summary = monitor.summary()
    assert summary["fired"] == {"version_lag": STEPS - BREAK + 1} and summary["events"] == STEPS - BREAK + 1


def test_reward_hacking_ignores_a_single_noisy_eval_dip():
    monitor = HealthMonitor(HealthConfig(window=1, hacking_patience=2))
    # Evals at steps 5, 10, 15: 0.60 (best), a dip to 0.50 while reward rose (strike 1),
    # then a recovery to 0.58 (strikes reset): never two strikes in a row.
    for step, (reward, accuracy) in enumerate([(0.5, 0.60), (0.7, 0.50), (0.8, 0.58), (0.9, 0.50)], start=1):
        monitor.observe(step, {"reward/mean": reward, "eval/accuracy": accuracy})
    assert monitor.events == []  # strikes at steps 2 and 4, reset by step 3
    monitor.observe(5, {"reward/mean": 1.0, "eval/accuracy": 0.49})  # second strike in a row
    [event] = monitor.events
    assert event.monitor == "reward_hacking" and event.value == pytest.approx(0.11)


def test_throughput_drop_ignores_a_transient_slowdown():
    """What a shared CPU did to a real quickstart run: 3 steps at a tenth of the speed."""
    monitor = HealthMonitor(HealthConfig())
    for step in range(1, 41):
        slow = 10 <= step <= 12
        monitor.observe(step, {"throughput/rollout_tokens_per_s": 100.0 if slow else 1000.0 + step})
    assert monitor.events == []


def test_recorded_quickstart_run_fires_only_at_cpu_contention():
    """A real 60-step quickstart (eval every 10), recorded on a 2-core machine shared with three
    other jobs. Learning was healthy (held-out 0.125 -> 0.15, entropy ~1.1, degenerate groups
    ~0.75, |corr(length, reward)| < 0.2); the only firing is throughput_drop, at the two
    episodes where neighbours took the CPU and rollouts took 4-9 s instead of under 1 s."""
    from pathlib import Path

    path = Path(__file__).parent / "data" / "quickstart_60_steps.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    monitor = replay(rows)
    assert {e.monitor for e in monitor.events} == {"throughput_drop"}
    slow_steps = {r["step"] for r in rows if r["time/rollout"] > 4.0}
    for event in monitor.events:  # each firing follows slow rollouts within the median window
        assert slow_steps & set(range(event.step - 4, event.step + 1))
    # Without the throughput monitor's input nothing fires: learning itself was healthy.
    quiet = [{k: v for k, v in r.items() if k != "throughput/rollout_tokens_per_s"} for r in rows]
    assert replay(quiet).events == []
