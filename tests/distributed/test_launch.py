"""``asyncrl train ... trainer.gpus=2`` end to end on CPU (two gloo ranks, fresh interpreters, as
a user starts them): rank 0 alone writes metrics and the summary, each rank logs to its own file,
the memory report covers every rank, the sharded checkpoint resumes and its HF export loads; and
when a rank is killed, the launcher stops the other and names the dead rank, leaving the last
complete checkpoint intact."""
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
def test_two_rank_run_writes_once_and_logs_per_rank(tmp_path):
    proc = _launch(tmp_path, "trainer.steps=3", "trainer.checkpoint_every=2")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(summary["memory_per_rank"]) == 2 and all(r["peak_mib"] for r in summary["memory_per_rank"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: no duplicated rows
    assert all(r["memory/rank0_peak_mib"] > 0 and r["memory/rank1_peak_mib"] > 0 for r in rows)
    assert all(r["actor/kl_loss"] >= 0 for r in rows)
    for rank in (0, 1):
        assert (run / "logs" / f"rank_{rank}.log").read_text().startswith(f"rank {rank} (pid ")
    assert out.count("asyncrl run summary") == 1  # printed by rank 0 only
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_000003" and _complete(latest)
    assert AutoModelForCausalLM.from_pretrained(latest).config.model_type == "qwen3"


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_named_and_keeps_the_checkpoint(tmp_path):
    proc = _launch(tmp_path, "trainer.steps=500", "trainer.checkpoint_every=1")
    run = tmp_path / "run"
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
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
