"""One run's clock and record, shared by the TRL and asyncrl runners of bench/peer_trl.py.

Training time is the wall time between consecutive step ends, with held-out evaluations
cut out (the clock restarts after each), so "seconds" never include evaluation, and both
frameworks' numbers include everything else their loop does between steps (data loading,
logging, callbacks).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Limits:
    """Stop at ``steps`` optimizer steps or ``budget`` seconds of training, whichever comes
    first; evaluate every ``eval_every`` steps (0: only before and after)."""

    steps: Optional[int] = None
    budget: Optional[float] = None
    eval_every: int = 0

    def done(self, step: int, seconds: float) -> bool:
        return (self.steps is not None and step >= self.steps) or (self.budget is not None and seconds >= self.budget)


@dataclass
class RunRecord:
    """Per-step wall seconds, per-step stage seconds, completions and tokens, and evaluations."""

    framework: str
    seed: int
    step_seconds: list[float] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)
    completions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    startup_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def train_seconds(self) -> float:
        return sum(self.step_seconds)

    def summary(self) -> dict:
        """Medians per step (shared machines stall single steps) and totals."""
        n, total = len(self.step_seconds), self.train_seconds
        med = statistics.median(self.step_seconds) if n else float("nan")
        keys = sorted({k for s in self.stages for k in s})
        stage_median = {k: statistics.median(s.get(k, 0.0) for s in self.stages) for k in keys}
        stage_mean = {k: sum(s.get(k, 0.0) for s in self.stages) / max(n, 1) for k in keys}
        per_step = sum(self.completions) / max(n, 1)
        return {"framework": self.framework, "seed": self.seed, "steps": n, "train_seconds": total,
                "s_per_step_median": med, "s_per_step_mean": total / max(n, 1),
                "completions_per_s": sum(self.completions) / max(total, 1e-9),
                "completions_per_s_median_step": per_step / med if n else float("nan"),
                "gen_tokens_per_s": sum(self.tokens) / max(total, 1e-9),
                "stage_median_s": stage_median, "stage_mean_s": stage_mean,
                "startup_seconds": self.startup_seconds,
                "first_eval": self.evals[0] if self.evals else None, "last_eval": self.evals[-1] if self.evals else None,
                **self.extra}

    def to_json(self) -> dict:
        return {"summary": self.summary(), "step_seconds": self.step_seconds, "stages": self.stages,
                "completions": self.completions, "tokens": self.tokens, "evals": self.evals}


class StepClock:
    """Measures steps as the time between step ends; ``evaluate`` runs off the clock."""

    def __init__(self, record: RunRecord, limits: Limits, evaluate: Optional[Callable[[object], dict]]):
        self.record, self.limits, self.evaluate = record, limits, evaluate
        self.last = time.perf_counter()

    def restart(self) -> None:
        self.last = time.perf_counter()

    def eval_now(self, model, step: int) -> None:
        if self.evaluate is None:  # throughput-only settings (h200)
            return
        result = self.evaluate(model)
        self.record.evals.append({"step": step, "train_seconds": self.record.train_seconds, **result})

    def step_done(self, step: int, stages: dict[str, float], completions: int, tokens: int, model) -> bool:
        """Record a finished step; evaluate when due; True when the run should stop."""
        now = time.perf_counter()
        r = self.record
        r.step_seconds.append(now - self.last)
        r.stages.append(stages)
        r.completions.append(completions)
        r.tokens.append(tokens)
        stop = self.limits.done(step, r.train_seconds)
        if stop or (self.limits.eval_every and step % self.limits.eval_every == 0):
            self.eval_now(model, step)
        self.restart()
        return stop


class Baton:
    """Strict turn-taking between a framework's loop in a worker thread and the main thread,
    so two frameworks alternate step by step and see the same machine load (a shared CPU's
    load swings by minutes; run one after the other, they would not).

    Worker: ``wait_turn()`` before each step, ``pass_back()`` after it, ``finish()`` at the end.
    Main: ``turn()`` lets the worker run exactly one step (returns at once once it finished).
    """

    def __init__(self):
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self.finished = False

    def wait_turn(self) -> None:
        self._go.acquire()

    def pass_back(self) -> None:
        self._back.release()

    def finish(self) -> None:
        self.finished = True
        self._back.release()

    def turn(self) -> None:
        if not self.finished:
            self._go.release()
            self._back.acquire()

    def drain(self) -> None:
        """Let the worker run its remaining steps alone."""
        while not self.finished:
            self.turn()
