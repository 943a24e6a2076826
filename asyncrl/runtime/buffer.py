"""The bounded buffer between the rollout loop and the train loop: scored groups, oldest first.

"Oldest" is the admission index k given by the staleness manager. The trainer takes groups
strictly in admission order, skipping only groups that were released (dropped): a group that
is still running holds back the ones admitted after it. This order is the half of the
staleness bound that the trainer owns (staleness.py: batch j holds groups jB … (j+1)B − 1,
minus released ones, plus the next ones). Without it a straggler finished after its slot
would be trained many versions late; ``runtime.group_timeout_s`` bounds the wait instead.

Bound: with admission as in staleness.py, groups finished but not taken ≤ (η + 1)·B, so the
buffer never holds more; ``put`` beyond ``capacity`` is a bug and raises.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from asyncrl.types import Example, RequestOutput


@dataclass
class ScoredGroup:
    """One prompt's completions with their scores, as the rollout loop hands them over."""

    example: Example
    output: RequestOutput
    scores: list[float]
    correct: list[float]
    admit_index: int
    admit_version: int
    admitted_at: float = field(default_factory=time.perf_counter)
    round_index: int = 0  # the rollout round (its seed) that generated it

    @property
    def oldest_version(self) -> int:
        versions = [v for c in self.output.completions for v in c.versions]
        return min(versions) if versions else self.admit_version


class RolloutBuffer:
    """Thread-safe buffer of :class:`ScoredGroup` keyed by admission index.

    Invariant: ``take`` returns groups in increasing admission index, and index i is returned
    only after every index < i was returned or released."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._groups: dict[int, ScoredGroup] = {}
        self._released: set[int] = set()
        self._cursor = 0  # the lowest admission index not yet taken or skipped
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    @property
    def cursor(self) -> int:
        """Admission indices below this were taken (trained) or released; none above was taken."""
        with self._cond:
            return self._cursor

    def put(self, group: ScoredGroup) -> None:
        with self._cond:
            if len(self._groups) >= self.capacity:
                raise RuntimeError(f"buffer over capacity {self.capacity}: admission control is broken")
            self._groups[group.admit_index] = group
            self._cond.notify_all()

    def release(self, admit_index: int) -> None:
        """Group ``admit_index`` will never arrive (dropped): the trainer skips it."""
        with self._cond:
            self._released.add(admit_index)
            self._cond.notify_all()

    def ready(self, n: int) -> bool:
        """True when the next ``n`` groups in admission order are all here."""
        with self._cond:
            return self._ready(n)

    def _ready(self, n: int) -> bool:
        i, found = self._cursor, 0
        while found < n:
            if i in self._groups:
                found += 1
            elif i not in self._released:
                return False
            i += 1
        return True

    def take(self, n: int, poll: float = 0.5, check: Callable[[], None] = lambda: None) -> list[ScoredGroup]:
        """The next ``n`` groups in admission order, waiting as long as needed; ``check()`` runs
        every ``poll`` seconds while waiting and may raise (a dead rollout loop must not hang
        the trainer)."""
        with self._cond:
            while not self._ready(n):
                check()
                self._cond.wait(poll)
            out = []
            while len(out) < n:
                if self._cursor in self._groups:
                    out.append(self._groups.pop(self._cursor))
                self._released.discard(self._cursor)
                self._cursor += 1
            return out
