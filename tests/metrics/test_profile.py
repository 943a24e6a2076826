"""Stage profile and Amdahl arithmetic, against hand-derived values."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from asyncrl.metrics.profile import (ASYNC_LANES, StageProfile, amdahl_speedup, amdahl_table, headline,
                                     overlap, profile_from_rows, profile_table, project_seconds)

# A serial step of 10 s: rollout is p = 0.6 of it, actor_update p = 0.2.
SERIAL = {"rollout": 6.0, "reward": 1.0, "old_logprobs": 1.0, "ref_logprobs": 0.0,
          "actor_update": 2.0, "critic_update": 0.0}


def test_amdahl_serial_hand_values():
    # speed-up = 1 / ((1 - p) + p / k)
    assert amdahl_speedup(SERIAL, "rollout", 2.0) == pytest.approx(1 / (0.4 + 0.3))   # 1.4286
    assert amdahl_speedup(SERIAL, "rollout", 5.0) == pytest.approx(1 / (0.4 + 0.12))  # 1.9231
    assert amdahl_speedup(SERIAL, "rollout", float("inf")) == pytest.approx(2.5)      # 1 / 0.4
    assert amdahl_speedup(SERIAL, "actor_update", 2.0) == pytest.approx(1 / (0.8 + 0.1))


def test_amdahl_table_skips_idle_and_zero_stages():
    table = amdahl_table({**SERIAL, "trainer_wait": 3.0})
    assert set(table) == {"rollout", "reward", "old_logprobs", "actor_update"}
    assert table["rollout"] == pytest.approx({"2x": 1 / 0.7, "5x": 1 / 0.52, "inf": 2.5})
    # A wait stage is not work: it neither gets a row nor dilutes the other stages' shares.
    assert table["actor_update"]["inf"] == pytest.approx(10 / 8)


def test_lane_model_projection_hand_values():
    # rollout lane = rollout + reward = 7 s, train lane = 1 + 0 + 2 + 0 = 3 s, weight_sync 0.5 s serial.
    seconds = {**SERIAL, "weight_sync": 0.5}
    assert project_seconds(seconds, {}, ASYNC_LANES) == pytest.approx(7.5)           # max(7, 3) + 0.5
    # rollout 2x: lanes 3 + 1 = 4 and 3 -> 4 + 0.5 = 4.5; 7.5 / 4.5 = 1.6667
    assert amdahl_speedup(seconds, "rollout", 2.0, ASYNC_LANES) == pytest.approx(7.5 / 4.5)
    # Speeding up the shorter lane buys nothing: the step is bound by the rollout lane.
    assert amdahl_speedup(seconds, "actor_update", float("inf"), ASYNC_LANES) == pytest.approx(1.0)


def test_overlap_hand_values():
    seconds = {**SERIAL, "weight_sync": 0.5}
    # work 10.5 s ran in 8 s of wall: hidden 2.5 s = 23.8% of the work; perfect overlap would
    # hide 10.5 - 7.5 = 3 s, so efficiency 2.5 / 3 = 0.8333.
    result = overlap(seconds, wall_seconds=8.0)
    assert result["overlap"] == pytest.approx(2.5 / 10.5)
    assert result["overlap_efficiency"] == pytest.approx(2.5 / 3.0)
    assert overlap(seconds, wall_seconds=10.5)["overlap"] == 0.0  # sequential: nothing hidden


def test_stage_profile_cumulative_and_tokens_per_s():
    profile = StageProfile()
    step = profile.observe(SERIAL, rollout_tokens=600)
    # train stages: old 1 + ref 0 + actor 2 + critic 0 = 3 s -> 600 / 3 = 200 tok/s
    assert step == {"throughput/train_tokens_per_s": pytest.approx(200.0)}
    profile.observe({**SERIAL, "rollout": 4.0}, rollout_tokens=400)
    summary = profile.summary()
    assert summary["steps"] == 2
    assert summary["stage_seconds"]["rollout"] == pytest.approx(10.0)
    assert summary["wall_seconds"] == pytest.approx(18.0)  # 10 + 8, serial
    assert summary["step_seconds_mean"] == pytest.approx(9.0)
    assert summary["stage_share"]["rollout"] == pytest.approx(10 / 18)
    assert summary["tokens_per_s"] == pytest.approx({"rollout": 1000 / 10, "train": 1000 / 6})
    # cumulative p(rollout) = 10/18: inf -> 1 / (8/18) = 2.25
    assert summary["amdahl"]["rollout"]["inf"] == pytest.approx(2.25)
    assert "async" not in summary


def test_stage_profile_async_reports_overlap():
    profile = StageProfile(lanes=ASYNC_LANES)
    step = profile.observe({**SERIAL, "weight_sync": 0.5}, wall_seconds=8.0)
    assert step["async/overlap"] == pytest.approx(2.5 / 10.5)
    assert profile.summary()["async"]["overlap_efficiency"] == pytest.approx(2.5 / 3.0)


def test_async_rollout_tokens_per_s_uses_the_rollout_lane_time():
    """In async mode the trainer's timer has no rollout stage: the rate divides by the
    generation lane's busy time instead (not by 0, which printed "rollout 0 tok/s")."""
    profile = StageProfile(lanes=ASYNC_LANES)
    trainer_only = {k: v for k, v in SERIAL.items() if k != "rollout"}
    profile.observe(trainer_only, wall_seconds=3.0, rollout_tokens=900, rollout_seconds=2.0)
    profile.observe(trainer_only, wall_seconds=3.0, rollout_tokens=300, rollout_seconds=1.0)
    assert profile.summary()["tokens_per_s"]["rollout"] == pytest.approx(1200 / 3.0)


def test_profile_from_metrics_rows():
    rows = [{"step": 1, "time/step": 10.0, **{f"time/{k}": v for k, v in SERIAL.items()},
             "throughput/rollout_tokens_per_s": 100.0},  # 100 tok/s * 6 s = 600 tokens
            {"step": 2, "reward/mean": 0.5}]             # a row without timings is skipped
    profile = profile_from_rows(rows)
    assert profile.steps == 1
    assert profile.rollout_tokens == pytest.approx(600.0)
    assert dict(profile.stage_seconds) == SERIAL


def test_profile_table_and_headline():
    profile = StageProfile()
    profile.observe(SERIAL, rollout_tokens=600)
    out = io.StringIO()
    Console(file=out, width=200).print(profile_table(profile))
    text = out.getvalue()
    assert "rollout" in text and "60.0%" in text and "2.50x" in text and "1.43x" in text
    assert headline(profile) == "rollout is 60% of the step: 5x faster rollout -> step 1.92x faster (at most 2.50x)"
