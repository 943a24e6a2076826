"""A synthetic run directory, shaped like what ``asyncrl train`` writes, for report tests."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from asyncrl.metrics.health import HealthConfig, HealthMonitor
from asyncrl.metrics.profile import StageProfile
from asyncrl.metrics.sinks import JsonlSink

STAGE_SECONDS = {"rollout": 0.6, "reward": 0.05, "old_logprobs": 0.1, "ref_logprobs": 0.1,
                 "actor_update": 0.3, "critic_update": 0.0}


def synthetic_row(step: int, rng: random.Random, async_run: bool) -> dict:
    """One step's metrics; the KL blows past its budget from step 20 on, step 12 has a NaN loss."""
    stages = {k: v * rng.uniform(0.9, 1.1) for k, v in STAGE_SECONDS.items()}
    total = sum(stages.values())
    row = {
        "reward/mean": 0.3 + 0.01 * step, "reward/std": 0.4, "reward/accuracy": 0.3 + 0.01 * step,
        "groups/degenerate_fraction": 0.3, "response/length_mean": 5.0 + 0.05 * step, "response/length_max": 6.0,
        "throughput/rollout_tokens_per_s": 640.0 / stages["rollout"], "throughput/step_tokens_per_s": 640.0 / total,
        "throughput/samples_per_s": 128 / total, "kl/ref": 0.02 if step < 20 else 0.3, "actor/entropy": 1.0,
        "actor/pg_loss": math.nan if step == 12 else 0.01, "actor/grad_norm": 1.0,
        "actor/skipped_step": 1.0 if step == 12 else 0.0, "actor/lr": 1e-4,
        "memory/rollout_peak_mib": 300.0, "memory/actor_update_peak_mib": 450.0, "memory/peak_mib": 450.0,
        "time/step": total, **{f"time/{k}": v for k, v in stages.items()},
        **{f"share/{k}": v / total for k, v in stages.items()},
    }
    if step % 5 == 0:
        row["eval/accuracy"] = 0.4 + 0.005 * step
    if async_run:  # the trainer's timer has no rollout: generation runs beside it (async/rollout_seconds)
        row.update({"time/rollout": 0.0, "time/wait_rollout": 0.1, "async/rollout_seconds": stages["rollout"],
                    "async/window_seconds": total - stages["rollout"] + 0.15, "time/wait_trainer": 0.02,
                    "async/version_lag": float(step % 2), "async/staleness_violations": 0.0,
                    "async/staleness_mean": 0.8})
        row["time/step"] = total - stages["rollout"] + 0.1
        row.update({f"async/staleness_hist/{k}": float(rng.randint(0, 40)) for k in range(2)})
    return row


def make_run_dir(root: Path, steps: int = 30, async_run: bool = False) -> Path:
    """Write metrics.jsonl (through the real JSONL sink, health metrics included),
    health_events.jsonl, summary.json and config.yaml under ``root/run``."""
    run_dir = Path(root) / "run"
    run_dir.mkdir(parents=True)
    rng = random.Random(0)
    sink = JsonlSink(run_dir)
    health = HealthMonitor(HealthConfig(), events_path=run_dir / "health_events.jsonl")
    profile = StageProfile()
    for step in range(1, steps + 1):
        row = synthetic_row(step, rng, async_run)
        health.observe(step, row)
        row.update(health.step_metrics())
        row.update(profile.observe_row(row))
        sink.write(step, row)
    sink.close()
    summary = {"name": "synthetic", "seed": 0, "run_dir": str(run_dir), "steps": steps, "sft_accuracy": 0.4,
               "final_accuracy": 0.55, "accuracy_gain": 0.15, "sft_sampled_accuracy": 0.25,
               "final_sampled_accuracy": 0.5, "rl_seconds": 30.0, "wall_seconds": 40.0,
               "stage_seconds": dict(profile.stage_seconds), "profile": profile.summary(),
               "checkpoint": str(run_dir / "checkpoints" / "step_000030")}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "config.yaml").write_text("name: synthetic\ntrainer:\n  steps: 30\n")
    return run_dir
