"""The session's quickstart, run as a user runs it: ``python -m asyncrl train`` in its own process,
started when the session starts so that it trains on one core while the other tests run on the other.

The job is the suite's largest cost (220-420 s of a 650-1,200 s suite on 2 cores) and a single
thread (the recipe's ``trainer.torch_threads: 1``), so running it beside the tests instead of
inside a fixture's setup takes its time off the suite's wall clock. Its result does not depend on
the load beside it: a sync run with a fixed seed is bit-equal at equal steps, and only the step
count depends on the machine (``trainer.max_wall_seconds``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import asyncrl

# The recipe caps RL at 270 s; the session's run may take longer, since it shares the machine
# with the rest of the suite: a quiet machine reaches the recipe's 1,500 steps in ~290 s of RL,
# CI's loaded one took up to ~320 s alone, and one core of two is what this job gets beside the
# tests. The tests check learning at the recipe's steps, so the cap only guards against a hang.
WALL_SECONDS = 900


class QuickstartJob:
    """``python -m asyncrl train`` with the default recipe in a child process.

    Overrides: where to write (run dir, warm-start cache), no progress bar (a log file is not a
    terminal), and the wall cap above. Everything else is the recipe, seed 0, an empty cache."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.run_dir = self.root / "run"
        self.log = self.root / "train.log"
        args = ["train", f"logging.run_dir={self.run_dir}", f"sft.cache_dir={self.root / 'cache'}",
                "logging.progress=false", f"trainer.max_wall_seconds={WALL_SECONDS}"]
        env = dict(os.environ)  # the child imports the asyncrl these tests import (a worktree on PYTHONPATH)
        package_root = str(Path(asyncrl.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl", *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env)

    def result(self, timeout: float = 2 * WALL_SECONDS) -> tuple[Path, dict]:
        """Wait for the job; (run_dir, summary.json's contents). A failed job raises with its log's tail."""
        rc = self.proc.wait(timeout=timeout)
        summary = self.run_dir / "summary.json"
        if rc != 0 or not summary.exists():
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"`python -m asyncrl train` exited {rc} (log {self.log}):\n{tail}")
        return self.run_dir, json.loads(summary.read_text())

    def stop(self) -> None:
        """End the job if the session no longer needs it (its tests failed early or were interrupted)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the job checkpoints the step in flight and exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
