"""A fast end-to-end run: a few GRPO steps on the tiny model, finite metrics, a checkpoint
that transformers loads, and stage times that add up to the measured step time."""
import json
import math

import pytest
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false"]


@pytest.fixture()
def fast_cfg(tmp_path):
    def make(*extra):
        return load_config("quickstart", FAST + [f"logging.run_dir={tmp_path / 'run'}",
                                                 f"sft.cache_dir={tmp_path / 'cache'}", *extra])
    return make


def test_end_to_end_run_writes_everything(fast_cfg, tmp_path):
    summary = run_training(fast_cfg("trainer.checkpoint_every=2", "trainer.eval_every=2"))
    run = tmp_path / "run"
    assert summary["steps"] == 4
    for key in ("sft_accuracy", "final_accuracy", "steps", "wall_seconds", "stage_seconds"):
        assert key in json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward/mean", "reward/std", "reward/accuracy", "response/length_mean", "actor/clipfrac",
                "actor/entropy", "actor/grad_norm", "throughput/rollout_tokens_per_s", "time/rollout",
                "share/actor_update"):
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in rows), key
    assert "eval/accuracy" in rows[1]
    sampled_at = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sampled_at.count(4) == sampled_at.count(2) > 0  # the final eval is step 4's, not run twice
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"])
    assert model.config.model_type == "qwen3"
    assert (run / "config.yaml").read_text().startswith("name: quickstart")


def test_stage_times_add_up_to_the_step_time(fast_cfg):
    summary = run_training(fast_cfg("trainer.steps=6"))
    stage_total = sum(summary["stage_seconds"].values())
    assert abs(stage_total - summary["step_wall_seconds"]) <= 0.05 * summary["step_wall_seconds"]


def test_kl_term_loads_a_reference_and_reports_kl(fast_cfg, tmp_path):
    run_training(fast_cfg("algorithm.kl_coef=0.05", "actor.mini_batches=2"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["actor/kl_loss"]) and r["actor/kl_loss"] >= 0 for r in rows)
    assert all("kl/ref" in r and "rollout/logprob_gap" in r for r in rows)
    assert rows[0]["rollout/logprob_gap"] < 1e-3  # first step: rollout and trainer hold the same weights


def test_second_run_reuses_the_cached_warm_start(fast_cfg, tmp_path):
    first = run_training(fast_cfg())
    second = run_training(fast_cfg(f"logging.run_dir={tmp_path / 'run2'}"))  # the first run's dir is refused
    assert first["sft/cached"] == 0.0 and second["sft/cached"] == 1.0
    assert second["sft_accuracy"] == first["sft_accuracy"]


def test_engine_vs_trainer_logprob_gap_is_logged_every_step_without_a_recompute(fast_cfg, tmp_path):
    """The default GRPO run skips the old-log-prob forward (one optimizer step per batch); the
    gap then comes from the update's pre-step forward, so it is still there every step."""
    run_training(fast_cfg("trainer.steps=3"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert 0 <= r["rollout/logprob_gap"] <= r["rollout/logprob_gap_max"]
        assert r["rollout/logprob_gap_max"] < 1e-3  # engine and trainer: same fp32 weights
