"""trainer.resume: a run stopped anywhere continues from its latest complete checkpoint, and
with a fixed seed every learning metric of every step equals the uninterrupted run's.

What is compared: every metric except wall-clock and memory measurements (time/, share/,
throughput/, memory/, async timing and queue depths, weight-sync probe diagnostics:
``asyncrl.metrics.measured.TIMING_PREFIXES``), which
differ between any two runs. Sync and async with max_staleness=0 are deterministic, so the
rest must be bit-equal. Async with max_staleness >= 1 depends on thread timing even without a
stop (which groups a batch holds): there the test checks what resume promises regardless —
every step once, every trained prompt exactly once (none trained twice, none lost), the
staleness bound, full batches."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.metrics.measured import learning_metrics
from asyncrl.runtime import pipeline
from asyncrl.runtime.pipeline import run_training

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "logging.report=false", "trainer.eval_samples=0",
        "trainer.checkpoint_every=2", "trainer.eval_every=2"]
ASYNC0 = ["runtime.mode=async", "runtime.max_staleness=0", "runtime.rollout_process=false"]
# LoRA; the tiny warm start earns no reward in 4 steps (zero advantages): the entropy bonus moves B off zero
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.save_merged=true", "algorithm.kl_coef=0.01",
        "algorithm.entropy_coeff=0.01"]


class Killed(BaseException):
    """Stands for SIGKILL in-process: not an Exception, so no failure handler saves anything."""


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]



def killed_at(monkeypatch, step: int) -> None:
    """The next run dies at the start of ``step``: its rows up to step − 1 are written, its
    last checkpoint may be older (the resume must drop the rows after it)."""
    real = pipeline._run_step

    def run_step(controller, s, checkpoints):
        if s == step:
            raise Killed
        return real(controller, s, checkpoints)
    monkeypatch.setattr(pipeline, "_run_step", run_step)


@pytest.mark.parametrize("mode", [[], ASYNC0, LORA], ids=["sync", "async-eta0", "sync-lora"])
def test_a_resumed_run_equals_the_uninterrupted_one(cfg_of, tmp_path, monkeypatch, mode):
    whole = run_training(cfg_of(*mode, f"logging.run_dir={tmp_path / 'whole'}"))
    killed_at(monkeypatch, 4)  # checkpoint at 2, rows 1-3 written
    with pytest.raises(Killed):
        run_training(cfg_of(*mode))
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]
    if mode is LORA:  # the adapter saved at step 2 is a trained one (B left zero: the resume would prove little)
        from safetensors.torch import load_file

        adapter = load_file(str(tmp_path / "run" / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
        assert max(t.abs().max().item() for n, t in adapter.items() if ".lora_B." in n) > 0
    monkeypatch.undo()
    resumed = run_training(cfg_of(*mode, "trainer.resume=auto"))
    assert resumed["steps"] == 4 and resumed["resumed_from_step"] == 2
    got, want = rows(tmp_path / "run"), rows(tmp_path / "whole")
    assert [r["step"] for r in got] == [1, 2, 3, 4]  # row 3 of the killed run replaced, none twice
    for a, b in zip(got, want):
        assert learning_metrics(a) == learning_metrics(b), a["step"]
    assert "eval/accuracy" in got[3] and resumed["final_accuracy"] == whole["final_accuracy"]


def test_async_resume_trains_every_prompt_exactly_once(cfg_of, tmp_path, monkeypatch):
    """max_staleness=1: groups in flight at the checkpoint are regenerated, never trained
    twice. Every example is tagged with its stream position; the positions trained over the
    two segments are exactly 0 .. steps·B − 1 (no timeouts here, so nothing is released)."""
    from asyncrl.runtime import async_controller, resume

    trained: list[int] = []
    real_groups, real_next = async_controller._as_scored_groups, resume.CountingStream.__next__

    def tagged_next(self):
        example = real_next(self)
        example.uid = str(self.position - 1)
        return example

    def record(groups):
        trained.extend(int(g.example.uid) for g in groups)
        return real_groups(groups)

    monkeypatch.setattr(resume.CountingStream, "__next__", tagged_next)
    monkeypatch.setattr(async_controller, "_as_scored_groups", record)
    cfg = ["runtime.mode=async", "runtime.max_staleness=1", "runtime.rollout_process=false", "trainer.steps=5",
           "algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]
    real_step = pipeline._run_step
    monkeypatch.setattr(pipeline, "_run_step", lambda c, s, k: (_ for _ in ()).throw(Killed) if s == 4
                        else real_step(c, s, k))
    with pytest.raises(Killed):
        run_training(cfg_of(*cfg))
    monkeypatch.setattr(pipeline, "_run_step", real_step)
    del trained[8:]  # step 3 trained groups 8-11 after the step-2 checkpoint: the resumed run redoes them
    summary = run_training(cfg_of(*cfg, "trainer.resume=auto"))
    got = rows(tmp_path / "run")
    assert summary["steps"] == 5 and [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert sorted(trained) == list(range(5 * 4)) and len(set(trained)) == len(trained)
    assert all(r["async/staleness_violations"] == 0 and r["batch/samples"] == 16 for r in got)


def test_resume_never_refuses_a_run_dir_that_holds_a_run(cfg_of, tmp_path):
    from asyncrl.errors import RunDirError

    run_training(cfg_of("trainer.steps=1", "trainer.checkpoint_every=0"))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="already holds a run: continue it with trainer.resume=auto"):
        run_training(cfg_of("trainer.steps=1"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing appended


def test_auto_without_a_run_dir_continues_the_newest_run_of_that_name(cfg_of, tmp_path):
    """trainer.resume=auto with no logging.run_dir: the newest <time>-<name> run with a
    checkpoint; a longer trainer.steps extends a finished run."""
    out = [f"logging.output_dir={tmp_path / 'runs'}", "logging.run_dir=null", "trainer.checkpoint_every=0"]
    first = run_training(cfg_of(*out, "trainer.steps=2"))
    second = run_training(cfg_of(*out, "trainer.steps=3", "trainer.resume=auto"))
    assert second["run_dir"] == first["run_dir"] and second["steps"] == 3 and second["resumed_from_step"] == 2
    assert [r["step"] for r in rows(Path(first["run_dir"]))] == [1, 2, 3]


def test_kill_9_at_a_random_moment_then_resume_completes_every_step(cfg_of, tmp_path, sft_cache):
    """A real SIGKILL of `asyncrl train` at a random moment after its first checkpoint;
    trainer.resume=auto completes the planned steps with each step row exactly once, and every
    learning metric equals the uninterrupted run's. (bench/fault_injection.py runs the 10-run
    campaign, sync and async.)"""
    cfg = [*FAST, f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={sft_cache}", "trainer.steps=6",
           "trainer.checkpoint_every=1", "trainer.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", "quickstart", *cfg], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3 * (os.getpid() % 7) / 7)  # a moment that differs between runs of the suite
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its rollout process, as an OOM killer would
    proc.wait(30)
    assert latest.exists()
    summary = run_training(pipeline_config(cfg + ["trainer.resume=auto"]))
    assert summary["steps"] == 6
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    run_training(pipeline_config(cfg + [f"logging.run_dir={tmp_path / 'whole'}"]))
    assert [learning_metrics(r) for r in got] == [learning_metrics(r) for r in rows(tmp_path / "whole")]


def pipeline_config(overrides):
    from asyncrl.config import load_config

    return load_config("quickstart", overrides)


def test_an_async_lora_run_with_the_rollout_process_resumes(cfg_of, tmp_path, monkeypatch):
    """Async, the rollout process on the collective transport: the resumed weights reach the
    new child as a push does (the adapters only; the child got the base at its start)."""
    lora_async = [*LORA, "runtime.mode=async", "runtime.max_staleness=1", "runtime.rollout_process=true",
                  "runtime.weight_transport=collective", "algorithm.decoupled=true",
                  "algorithm.rollout_correction.level=token"]
    killed_at(monkeypatch, 4)
    with pytest.raises(Killed):
        run_training(cfg_of(*lora_async))
    monkeypatch.undo()
    resumed = run_training(cfg_of(*lora_async, "trainer.resume=auto"))
    assert resumed["steps"] == 4 and resumed["resumed_from_step"] == 2
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in got[2:] if "weight_sync/probe_gap" in r)


def test_a_lora_checkpoint_resumes_only_as_lora_and_a_full_one_only_as_full(cfg_of, tmp_path):
    """A LoRA checkpoint holds the adapter only (PEFT's format): resuming it without
    actor.lora is refused by name, and so is a full checkpoint resumed with actor.lora."""
    from asyncrl.errors import CheckpointError

    run_training(cfg_of(*LORA, "trainer.steps=2"))
    with pytest.raises(CheckpointError, match="a LoRA checkpoint"):
        run_training(cfg_of("trainer.steps=4", "trainer.resume=auto"))
    run_training(cfg_of("trainer.steps=2", f"logging.run_dir={tmp_path / 'full'}"))
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint"):
        run_training(cfg_of(*LORA, "trainer.steps=4", "trainer.resume=auto", f"logging.run_dir={tmp_path / 'full'}"))
