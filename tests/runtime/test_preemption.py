"""SIGTERM/SIGINT: the step in flight finishes, a complete checkpoint and the summary are
written, the rollout process is stopped (checked by pid), the CLI exits 0 saying how to
resume; a second signal exits at once. The signal is sent by the process to itself from inside
the phase under test, so it lands exactly there."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from asyncrl.cli import main
from asyncrl.training.checkpoint import is_complete, latest_checkpoint

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=5",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "logging.report=false", "trainer.eval_samples=0"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting to be reaped holds nothing
        return f.read().split()[2] == "Z"


def signal_self_during(monkeypatch, target, name: str, at_call: int = 2, sig=signal.SIGTERM) -> None:
    """Send ``sig`` to this process from inside ``target.name`` on its ``at_call``-th call."""
    real, calls = getattr(target, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # the handler runs at the next bytecode boundary: here, mid-phase
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapped)


@pytest.mark.parametrize("phase", ["rollout", "update", "checkpoint"])
def test_sigterm_finishes_the_step_checkpoints_and_exits_0(sft_cache, tmp_path, monkeypatch, capsys, phase):
    from asyncrl.runtime.executors import process
    from asyncrl.runtime.resume import RunCheckpoints
    from asyncrl.runtime.sync_controller import SyncController
    from asyncrl.training.actor import Actor

    extra = []
    if phase == "rollout":  # sync: the signal lands inside generate of step 2
        signal_self_during(monkeypatch, SyncController, "rollout")
    elif phase == "update":  # async with the rollout process: inside the actor update of step 2
        extra = ["runtime.mode=async", "runtime.rollout_process=true", "algorithm.decoupled=true",
                 "algorithm.rollout_correction.level=token"]
        signal_self_during(monkeypatch, Actor, "update")
    else:  # inside the periodic checkpoint write of step 2
        extra = ["trainer.checkpoint_every=2"]
        signal_self_during(monkeypatch, RunCheckpoints, "save", at_call=1, sig=signal.SIGINT)
    pids = []
    real_init = process.ProcessRolloutBackend.__init__

    def remember_pid(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pids.append(self.pid)
    monkeypatch.setattr(process.ProcessRolloutBackend, "__init__", remember_pid)
    run = tmp_path / "run"
    assert main(["train", "quickstart", *FAST, f"logging.run_dir={run}", f"sft.cache_dir={sft_cache}", *extra]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["preempted"] in ("SIGTERM", "SIGINT")
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    checkpoint = latest_checkpoint(run)
    assert checkpoint.name == "step_000002" and is_complete(checkpoint)
    assert "trainer.resume=auto" in capsys.readouterr().out
    if phase == "update":
        assert len(pids) == 1 and gone(pids[0])  # the rollout process was stopped
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_a_second_signal_exits_at_once_and_leaves_no_process(sft_cache, tmp_path):
    """A real `asyncrl train` (async, rollout process) gets SIGTERM twice: it exits at once
    with 128 + 15 and its rollout process is gone too."""
    run = tmp_path / "run"
    cfg = FAST + [f"logging.run_dir={run}", f"sft.cache_dir={sft_cache}", "trainer.steps=200",
                  "runtime.mode=async", "runtime.rollout_process=true", "algorithm.decoupled=true",
                  "algorithm.rollout_correction.level=token"]
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "train", "quickstart", *cfg],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    stderr = []
    reader = threading.Thread(target=lambda: [stderr.append(line) for line in proc.stderr], daemon=True)
    reader.start()
    proc.send_signal(signal.SIGTERM)
    # The second signal only after the first handler ran (it prints): Python runs handlers between
    # bytecodes of the main thread, so two signals sent while it sits in one long C call arrive
    # as one, and the run then stops gracefully with 0 (seen in a loaded full-suite run).
    deadline = time.monotonic() + 60
    while not any("received: finishing the current step" in line for line in stderr):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM and time.monotonic() - start < 10
    reader.join(10)
    assert "Traceback" not in "".join(stderr)
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children and all(gone(pid) for pid in children)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
