"""Guards against poisoned weights and runs that train nothing: a NaN parameter is caught at
the step that made it (nothing poisoned is saved), a streak of skipped updates stops the run
with a checkpoint of its last good step, and the CLI reports each in one line."""
import json
import math

import pytest
import torch

from asyncrl.cli import main
from asyncrl.errors import SkippedStepsError
from asyncrl.runtime.guards import SkippedSteps
from asyncrl.training.checkpoint import complete_checkpoints, latest_checkpoint

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=5",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "logging.report=false", "trainer.eval_samples=0", "trainer.checkpoint_every=1"]


def test_a_streak_of_skipped_steps_stops():
    guard = SkippedSteps(limit=3)
    for step, skipped in enumerate([1.0, 1.0, 0.0, 1.0, 1.0], start=1):  # a real update resets the streak
        guard.observe(step, {"actor/skipped_step": skipped})
    with pytest.raises(SkippedStepsError, match="3 consecutive steps \\(up to step 6\\)"):
        guard.observe(6, {"actor/skipped_step": 1.0})
    SkippedSteps(limit=0).observe(1, {"actor/skipped_step": 1.0})  # 0: never stops


def test_an_injected_nan_parameter_is_caught_at_its_step(sft_cache, tmp_path, monkeypatch, capsys):
    """A NaN written into a weight by the optimizer step of step 3: the run stops at step 3 naming
    the parameter; steps 1-2 stay the healthy, complete checkpoints; no NaN is ever saved."""
    from asyncrl.training.actor import Actor

    real, updates = Actor.update, []

    def poisoned(self, batch):
        updates.append(1)
        if len(updates) == 3:
            real_step = self.optimizer.step

            def step_then_nan(*args, **kwargs):
                real_step(*args, **kwargs)
                with torch.no_grad():
                    self.model.model.norm.weight[0] = float("nan")
            self.optimizer.step = step_then_nan
        return real(self, batch)
    monkeypatch.setattr(Actor, "update", poisoned)
    run = tmp_path / "run"
    assert main(["train", "quickstart", *FAST, f"logging.run_dir={run}", f"sft.cache_dir={sft_cache}"]) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # (transformers' loading bars go to stderr too)
    assert line.startswith("asyncrl: error: step 3: parameter model.norm.weight holds 1 NaN/Inf values")
    assert "step_000002" in line and "Traceback" not in err and (run / "error.log").is_file()
    assert [p.name for p in complete_checkpoints(run)] == ["step_000001", "step_000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_an_update_that_never_happens_stops_the_run(sft_cache, tmp_path, monkeypatch, capsys):
    """Every loss non-finite (as a reward total of 1e308 x 2 made it): no update at all. The run
    stops after trainer.max_skipped_steps steps with a named error and a checkpoint of them."""
    import asyncrl.training.actor as actor_module
    from asyncrl.algorithms import compute_policy_loss

    def nan_loss(name, inp, cfg):
        out = compute_policy_loss(name, inp, cfg)
        out.loss = out.loss * math.nan
        return out
    monkeypatch.setattr(actor_module, "compute_policy_loss", nan_loss)
    run = tmp_path / "run"
    rc = main(["train", "quickstart", *FAST, f"logging.run_dir={run}", f"sft.cache_dir={sft_cache}",
               "trainer.max_skipped_steps=2", "trainer.checkpoint_every=0"])
    err = capsys.readouterr().err
    assert rc == 1 and "2 consecutive steps (up to step 2) skipped their update" in err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/skipped_step"] for r in rows] == [1.0, 1.0]
    assert latest_checkpoint(run).name == "step_000002"  # written after the failure: weights untouched
