"""Stops for a run that trains nothing: N consecutive steps whose update was skipped.

A step's update is skipped when its loss or gradient is not finite (actor.py); one such step
is noise, a streak means the run is burning compute on no update at all (a reward that
overflows, a learning rate that blew the weights up) and must stop with a reason. Non-finite
*weights* are caught inside the optimizer step itself (param_check.py).
"""
from __future__ import annotations

from asyncrl.errors import SkippedStepsError


class SkippedSteps:
    """Counts consecutive steps with ``actor/skipped_step == 1`` (every optimizer step of the
    step skipped); :meth:`observe` raises :class:`SkippedStepsError` at ``limit`` (0: never)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def observe(self, step: int, metrics: dict) -> None:
        skipped = metrics.get("actor/skipped_step")
        self.streak = self.streak + 1 if skipped is not None and skipped >= 1.0 else 0
        if self.limit and self.streak >= self.limit:
            raise SkippedStepsError(
                f"{self.streak} consecutive steps (up to step {step}) skipped their update: the loss or gradient "
                "was NaN/Inf every time. Check reward/failed_fraction and the rewards' scale, lower actor.lr; "
                "trainer.max_skipped_steps=0 disables this stop")
