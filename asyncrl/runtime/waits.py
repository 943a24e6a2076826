"""Waits that never hang a run in silence.

Every wait on another party (the rollout process, the weight channel, a collective, rollout
data) goes through a :class:`Deadline`: polled in short slices, it prints one line when the
wait grows long ("still waiting for X after 60 s") and raises :class:`HangError` naming X
when it passes ``runtime.hang_timeout_s``. A stopped-but-alive peer (SIGSTOP, a wedged CUDA
kernel, a deadlocked NCCL call) is thus reported and, past the limit, ends the run with a
message instead of blocking it forever.
"""
from __future__ import annotations

import time
from typing import Optional

from asyncrl.errors import HangError

DEFAULT_HANG_TIMEOUT_S = 900.0  # runtime.hang_timeout_s
WARN_AFTER_S = 60.0             # the first "still waiting" line (at most half the limit)


class Deadline:
    """One wait's clock: ``check()`` in the wait loop warns once when long, raises when over.

    Invariant: ``check`` raises only after ``timeout`` seconds since construction, and
    prints at most once."""

    def __init__(self, what: str, timeout: Optional[float], hint: str = "", warn_after: Optional[float] = None):
        self.what, self.timeout, self.hint = what, timeout, hint
        self.warn_after = warn_after if warn_after is not None else min(WARN_AFTER_S, (timeout or 2 * WARN_AFTER_S) / 2)
        self.start = time.monotonic()
        self._warned = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check(self) -> None:
        elapsed = self.elapsed
        if self.timeout is not None and elapsed >= self.timeout:
            hint = f"; {self.hint}" if self.hint else ""
            raise HangError(f"{self.what} did not finish in {self.timeout:g} s{hint} (runtime.hang_timeout_s)")
        if not self._warned and elapsed >= self.warn_after:
            self._warned = True
            from asyncrl.metrics.console import console

            limit = f" (the run stops at {self.timeout:g} s: runtime.hang_timeout_s)" if self.timeout else ""
            console.print(f"[yellow]still waiting for {self.what} after {elapsed:.0f} s[/]{limit}")
