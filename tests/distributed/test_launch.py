"""``asyncrl train ... trainer.gpus=2`` as a user starts it (two gloo ranks in fresh interpreters
on CPU): it trains and checkpoints, and when a rank is killed with SIGKILL the launcher stops the
other at once, names the dead rank and its signal, and the last complete checkpoint stays
intact and loadable. (The job itself on 2 ranks, summary and logs: test_two_rank_job.py.)"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.runtime.test_pipeline import FAST

REPO = Path(__file__).resolve().parents[2]
TWO_RANKS = [*FAST, "trainer.gpus=2", "trainer.device=cpu", "trainer.prompts_per_step=3", "trainer.torch_threads=1",
             "logging.report=false", "trainer.eval_samples=0", "task.num_eval=8", "algorithm.kl_coef=0.05"]


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [sys.executable, "-m", "asyncrl", "train", "quickstart", *TWO_RANKS, f"logging.run_dir={tmp_path / 'run'}",
            f"sft.cache_dir={tmp_path / 'cache'}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _complete(step_dir: Path) -> bool:
    return all((step_dir / name).exists() for name in ("model.safetensors", "trainer_state.json", "dcp/.metadata",
                                                       "rng/rank_0.pt", "rng/rank_1.pt"))


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_named_and_keeps_the_checkpoint(tmp_path):
    proc = _launch(tmp_path, "trainer.steps=500", "trainer.checkpoint_every=1")
    run = tmp_path / "run"
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_000002").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    text = (run / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()[:text.count("\n")]]  # complete lines only
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # written once, by rank 0
    pid = int(re.match(r"rank 1 \(pid (\d+)\)", (run / "logs" / "rank_1.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert time.monotonic() - killed < 60
    assert "rank 1 of 2 killed by SIGKILL; the other ranks were stopped" in err
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert _complete(latest)
    AutoModelForCausalLM.from_pretrained(latest)
