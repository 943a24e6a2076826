"""`asyncrl train` in a fresh process, as a new user runs it, and what the benches read back.

Shared by the benches that compare quickstart runs: quickstart_seeds.py, readme_numbers.py,
fsdp_quickstart_learning.py (lora_quickstart.py's ``run`` is the same as ``run_train`` with
``kind`` added to the summary, its table cells ``accuracy_cells``, its ending ``write_json``).
Benches import it as a sibling module (``python bench/x.py`` puts bench/ on ``sys.path``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass
class TrainProcess:
    """One running `asyncrl train`: its run dir, the process and when it started."""

    run_dir: Path
    proc: subprocess.Popen
    started: float

    def finish(self) -> dict:
        """Wait for the run: its summary.json plus ``process_seconds`` (the whole process's
        wall time, SFT warm start included); a failed run stops the bench, named."""
        if self.proc.wait():
            raise SystemExit(f"{self.run_dir.name} failed with exit code {self.proc.returncode}")
        summary = json.loads((self.run_dir / "summary.json").read_text())
        summary["process_seconds"] = time.perf_counter() - self.started
        return summary


def start_train(seed: int, run_dir: Path, cache: Path, overrides: Sequence[str] = (),
                env: Optional[dict] = None) -> TrainProcess:
    """Start `asyncrl train seed=<seed> logging.run_dir=<run_dir> <overrides>` with the warm-start
    cache at ``cache`` (a new dir: the SFT runs; a seed's earlier cache: it is reused) and
    ``env`` added to this process's environment; the run's stdout is discarded."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"seed={seed}", f"logging.run_dir={run_dir}",
           "logging.progress=false", *overrides]
    full_env = {**os.environ, "ASYNCRL_CACHE": str(cache), **(env or {})}
    return TrainProcess(run_dir, subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL), time.perf_counter())


def run_train(seed: int, run_dir: Path, cache: Path, overrides: Sequence[str] = (),
              env: Optional[dict] = None) -> dict:
    """``start_train`` and wait: the run's summary with ``process_seconds``."""
    return start_train(seed, run_dir, cache, overrides, env).finish()


def gain_points(summary: dict, key: str) -> float:
    """Held-out accuracy gain of RL over the SFT warm start, in points; ``key`` is
    ``sampled_accuracy`` or ``accuracy`` (greedy)."""
    return 100 * (summary[f"final_{key}"] - summary[f"sft_{key}"])


def accuracy_cells(summary: dict) -> str:
    """The markdown cells ``sampled SFT -> RL | gain | greedy SFT -> RL | gain``."""
    return (f"{summary['sft_sampled_accuracy']:.3f} -> {summary['final_sampled_accuracy']:.3f} | "
            f"{gain_points(summary, 'sampled_accuracy'):+.1f} | "
            f"{summary['sft_accuracy']:.3f} -> {summary['final_accuracy']:.3f} | {gain_points(summary, 'accuracy'):+.1f}")


def write_json(path: Optional[Path], rows: list) -> None:
    """The bench's rows as indented JSON at ``path`` (its folder created); no path: nothing."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2))
