"""Stage profile and Amdahl arithmetic, against hand-derived values; sync and async rows."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from asyncrl.metrics.profile import (StageProfile, StepTimes, amdahl_speedup, amdahl_table, headline, is_wait,
                                     lane_overlap, profile_from_rows, profile_table, project_seconds,
                                     throughput_line)

# A serial step of 10 s: rollout is p = 0.6 of it, actor_update p = 0.2.
SERIAL = {"rollout": 6.0, "reward": 1.0, "old_logprobs": 1.0, "ref_logprobs": 0.0,
          "actor_update": 2.0, "critic_update": 0.0}


def sync_row(step: int = 1, **stages) -> dict:
    times = {**SERIAL, **stages}
    total = sum(times.values())
    # 600 generated tokens in 6 s of rollout; 600 trained tokens over the 10 s step
    return {"step": step, "time/step": total, **{f"time/{k}": v for k, v in times.items()},
            "throughput/rollout_tokens_per_s": 600 / times["rollout"], "throughput/step_tokens_per_s": 600 / total}


# An async step as the controller logs it: the trainer thread's stages (rollout 0, wait_rollout 1 s)
# add up to time/step = 5 s; generation ran 6 s of a 7 s window beside it; 2 s of the window the
# trainer spent outside the step (eval, logging).
ASYNC_ROW = {"step": 1, "time/step": 5.0, "time/rollout": 0.0, "time/reward": 1.0, "time/old_logprobs": 1.0,
             "time/actor_update": 2.0, "time/wait_rollout": 1.0, "time/wait_trainer": 0.3,
             "async/rollout_seconds": 6.0, "async/window_seconds": 7.0,
             "throughput/rollout_tokens_per_s": 100.0, "throughput/step_tokens_per_s": 40.0}


def test_wait_stages_are_the_controllers_names():
    assert is_wait("wait_rollout") and is_wait("wait_trainer") and not is_wait("rollout")


def test_amdahl_serial_hand_values():
    # speed-up = 1 / ((1 - p) + p / k)
    assert amdahl_speedup(SERIAL, "rollout", 2.0) == pytest.approx(1 / (0.4 + 0.3))   # 1.4286
    assert amdahl_speedup(SERIAL, "rollout", 5.0) == pytest.approx(1 / (0.4 + 0.12))  # 1.9231
    assert amdahl_speedup(SERIAL, "rollout", float("inf")) == pytest.approx(2.5)      # 1 / 0.4
    assert amdahl_speedup(SERIAL, "actor_update", 2.0) == pytest.approx(1 / (0.8 + 0.1))


def test_amdahl_table_skips_wait_and_zero_stages():
    table = amdahl_table({**SERIAL, "wait_rollout": 3.0})
    assert set(table) == {"rollout", "reward", "old_logprobs", "actor_update"}
    assert table["rollout"] == pytest.approx({"2x": 1 / 0.7, "5x": 1 / 0.52, "inf": 2.5})
    # A wait stage is not work: it neither gets a row nor dilutes the other stages' projections.
    assert table["actor_update"]["inf"] == pytest.approx(10 / 8)


def test_concurrent_lanes_projection_hand_values():
    # rollout lane 6 s; trainer lane = reward 1 + old 1 + actor 2 + weight_sync 0.5 = 4.5 s -> step max = 6 s
    seconds = {**SERIAL, "weight_sync": 0.5}
    assert project_seconds(seconds, {}, concurrent=True) == pytest.approx(6.0)
    # rollout 2x: max(3, 4.5) = 4.5 -> 6 / 4.5 = 1.333
    assert amdahl_speedup(seconds, "rollout", 2.0, concurrent=True) == pytest.approx(6 / 4.5)
    # Speeding up the shorter lane buys nothing: the step is bound by the rollout lane.
    assert amdahl_speedup(seconds, "actor_update", float("inf"), concurrent=True) == pytest.approx(1.0)


def test_lane_overlap_hand_values():
    # R 6 s and T 4.5 s in a 7 s window: 3.5 s of the shorter lane's 4.5 s were hidden
    assert lane_overlap(6.0, 4.5, 7.0) == pytest.approx(3.5 / 4.5)
    assert lane_overlap(6.0, 4.5, 10.5) == 0.0  # took turns: nothing hidden
    assert lane_overlap(6.0, 4.5, 6.0) == 1.0   # perfectly hidden
    assert lane_overlap(0.0, 4.5, 4.5) == 0.0


def test_step_times_of_a_sync_row():
    times = StepTimes.from_row(sync_row())
    assert times.stage_seconds == SERIAL and times.wall_seconds == pytest.approx(10.0)
    assert times.rollout_tokens == pytest.approx(600) and times.train_tokens == pytest.approx(600)
    assert not times.concurrent
    assert StepTimes.from_row({"step": 2, "reward/mean": 0.5}) is None  # a row without timings


def test_step_times_of_an_async_row():
    times = StepTimes.from_row(ASYNC_ROW)
    # rollout = the lane's 6 s; between_steps = window 7 - step 5 = 2 s; wait_trainer is not a stage
    assert times.stage_seconds == {"rollout": 6.0, "reward": 1.0, "old_logprobs": 1.0, "actor_update": 2.0,
                                   "wait_rollout": 1.0, "between_steps": 2.0}
    assert times.wall_seconds == 7.0 and times.concurrent
    assert times.rollout_tokens == pytest.approx(600.0)    # 100 tok/s x 6 s
    assert times.train_tokens == pytest.approx(200.0)      # 40 tok/s x the 5 s step
    assert times.rollout_wait_seconds == pytest.approx(0.3)


def test_sync_profile_summary_hand_values():
    profile = profile_from_rows([sync_row(1), sync_row(2, rollout=4.0)])
    summary = profile.summary()
    assert summary["mode"] == "sync" and summary["steps"] == 2
    assert summary["stage_seconds"]["rollout"] == pytest.approx(10.0)
    assert summary["wall_seconds"] == pytest.approx(18.0)  # 10 + 8, serial
    assert summary["step_seconds_mean"] == pytest.approx(9.0)
    assert summary["stage_share"]["rollout"] == pytest.approx(10 / 18)
    assert sum(summary["stage_share"].values()) == pytest.approx(1.0)
    # 1200 tokens / 10 s of rollout; 1200 trained / 6 s of old_logprobs + actor_update
    assert summary["tokens_per_s"] == pytest.approx({"rollout": 120.0, "train": 200.0})
    assert summary["amdahl"]["rollout"]["inf"] == pytest.approx(2.25)  # 1 / (8/18)
    assert "async" not in summary


def test_async_profile_summary_hand_values():
    summary = profile_from_rows([ASYNC_ROW]).summary()
    assert summary["mode"] == "async"
    # trainer lane = reward 1 + old 1 + actor 2 + between 2 = 6 s, rollout lane 6 s, window 7 s
    assert summary["async"]["overlap"] == pytest.approx((6 + 6 - 7) / 6)
    assert summary["stage_share"]["rollout"] == pytest.approx(6 / 7)  # busy 86% of the wall time
    assert summary["tokens_per_s"] == pytest.approx({"rollout": 100.0, "train": 200 / 3})
    assert "wait_rollout" not in summary["amdahl"]  # waiting is never projected...
    assert summary["amdahl"]["rollout"]["inf"] == pytest.approx(1.0)  # ...and the lanes are equal: no gain
    assert summary["async"]["rollout_wait_seconds"] == pytest.approx(0.3)


def test_observe_row_returns_train_tokens_per_s():
    assert StageProfile().observe_row(sync_row()) == {"throughput/train_tokens_per_s": pytest.approx(200.0)}
    assert StageProfile().observe_row({"reward/mean": 1.0}) == {}


def test_profile_table_and_headline():
    summary = profile_from_rows([sync_row()]).summary()
    out = io.StringIO()
    Console(file=out, width=250).print(profile_table(summary))
    text = out.getvalue()
    assert "rollout" in text and "60.0%" in text and "2.50x" in text and "1.43x" in text
    assert headline(summary) == "rollout is 60% of the step: 5x faster rollout -> step 1.92x faster (at most 2.50x)"
    assert throughput_line(summary).startswith("rollout 100 tokens/s, training 200 tokens/s, 10.000 s per step")


def test_async_headline_and_line_say_the_lanes_run_concurrently():
    summary = profile_from_rows([ASYNC_ROW]).summary()
    assert headline(summary).startswith("rollout is 86% of the wall time (async")
    assert "async overlap 83%" in throughput_line(summary)
