"""StepGate: who may touch the engine's state now, engine steps or control calls, control first.

The engine's state (scheduler, block manager, the step in flight, the weights) is changed by
``step`` (a ``generate`` loop calls it back to back, in the rollout thread) and by control calls
from other threads: ``update_weights``, ``pause``, ``abort``, ``add_request``, ``close``.

Invariant: one holder at a time (re-entrant for its thread), and while a control call waits no
new step starts, so a control call waits for at most the step in flight. A plain lock has no
such bound: a thread that releases it and takes it back a few microseconds later (the next
``step`` of a ``generate`` loop) can win every race against a waiter that still has to be woken
up, and a weight update then waits step after step (OpenRLHF's and vLLM's weight-update paths
stop the scheduler first for the same reason: ``pause_generation`` before the load).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


class StepGate:
    def __init__(self):
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._controls_waiting = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Hold the engine for one step; waits while a control call is waiting."""
        with self._cond:
            self._cond.wait_for(lambda: self._controls_waiting == 0 or self._owned())
        with self._lock:
            yield

    @contextmanager
    def control(self) -> Iterator[float]:
        """Hold the engine for a control call; yields the seconds it waited for the holder
        before it (the step in flight, or another control call)."""
        started = time.perf_counter()
        with self._cond:
            self._controls_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._controls_waiting -= 1
                self._cond.notify_all()
        try:
            yield time.perf_counter() - started
        finally:
            self._lock.release()

    def _owned(self) -> bool:
        """The calling thread holds the gate already (a step inside a control call never waits
        for controls, or it would wait for itself)."""
        return self._lock._is_owned()
