"""Stage timing: every step is split into named stages whose times add up to the step.

The six stages of an RL step (DESIGN.md): rollout, reward (reward / values and
advantages), old_logprobs, ref_logprobs, actor_update, critic_update. Time spent
between stages (collation, bookkeeping) is charged to the stage that follows, so the
stage sum equals the measured step time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

STAGES = ("rollout", "reward", "old_logprobs", "ref_logprobs", "actor_update", "critic_update")


class StageTimer:
    """Wall time per stage for the current step, and cumulative over the run.

    Invariant: within a step, ``sum(step_seconds.values())`` equals the wall time from
    ``start_step`` to the end of the last stage (nothing is left unattributed).
    """

    def __init__(self, observers: tuple = ()):
        """``observers``: objects with ``start_step()`` and a ``stage(name)`` context
        manager (e.g. ``MemoryTracker``), entered around every stage this timer times."""
        self.observers = tuple(observers)
        self.step_seconds: dict[str, float] = {}
        self.total_seconds: dict[str, float] = defaultdict(float)
        self._mark = time.perf_counter()

    def start_step(self) -> None:
        self.step_seconds = {name: 0.0 for name in STAGES}
        for observer in self.observers:
            observer.start_step()
        self._mark = time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        """Charge the time since the previous stage ended, plus this block, to ``name``."""
        try:
            with ExitStack() as stack:
                for observer in self.observers:
                    stack.enter_context(observer.stage(name))
                yield
        finally:
            now = time.perf_counter()
            elapsed = now - self._mark
            self._mark = now
            self.step_seconds[name] = self.step_seconds.get(name, 0.0) + elapsed
            self.total_seconds[name] += elapsed

    def step_metrics(self) -> dict[str, float]:
        """``time/<stage>`` seconds and ``share/<stage>`` fractions of this step."""
        total = sum(self.step_seconds.values()) or 1e-12
        metrics = {"time/step": total}
        for name, seconds in self.step_seconds.items():
            metrics[f"time/{name}"] = seconds
            metrics[f"share/{name}"] = seconds / total
        return metrics
