"""Graceful preemption: SIGTERM (what clusters and schedulers send) and SIGINT (Ctrl-C).

The first signal only sets a flag; the training loop reads it after each step:

  * the step in flight is **finished**, not abandoned (its rollout, update and metrics are
    complete, so the checkpoint is a step boundary and nothing is half-applied), then no new
    step starts — in async mode the rollout side stops admitting work when the controller
    closes;
  * a checkpoint of that step and ``summary.json`` are written (the final held-out eval is
    skipped: a preempted job has seconds, not minutes), the rollout process and the reward
    workers are stopped, and the job exits 0 printing how to resume.

Before the loop starts (:meth:`Preemption.defer` not called yet: loading the model, the warm
start, the pre-RL eval) there is nothing to finish: the signal raises :class:`Preempted` at
once, the job cleans up (no empty run directory) and exits 0.

A second signal exits at once (status 128 + signal): every child process of this run is
killed first, so none is left behind; the last complete checkpoint stays the resume point.
That is the ``asyncrl`` command (``HARD_EXIT``, set by the CLI); in a Python session (a
notebook running ``asyncrl.train``) the second signal raises ``KeyboardInterrupt`` instead, so
the interpreter survives.
Child processes ignore SIGINT/SIGTERM themselves (a Ctrl-C reaches the whole process group):
the trainer stops them, and nobody prints a ``KeyboardInterrupt`` traceback.

Handlers are installed only in the main thread (Python delivers signals there); elsewhere
(a run started from a worker thread) :class:`Preemption` is inert.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Optional

from asyncrl.errors import Preempted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
HARD_EXIT = False  # the CLI process: a second signal ends it (see the module doc)


class Preemption:
    """Context manager: while active, a SIGTERM/SIGINT before :meth:`defer` raises
    :class:`Preempted`; after it, the first sets ``requested`` (its name), the second kills
    this run's child processes and exits immediately."""

    def __init__(self):
        self.requested: Optional[str] = None
        self.deferred = False
        self._previous: dict[int, object] = {}

    def defer(self) -> None:
        """From now on a signal only asks the loop to stop after its step."""
        self.deferred = True

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.deferred:
            self.deferred = True  # a second signal while unwinding exits at once
            self.requested = name
            raise Preempted(f"stopped by {name} before the first step: nothing was trained")
        if self.requested is not None:
            kill_children()
            os.write(2, f"\nasyncrl: second {name}: exiting now (the last complete checkpoint is the resume "
                        f"point)\n".encode())
            if not HARD_EXIT:
                raise KeyboardInterrupt
            os._exit(128 + signum)
        self.requested = name
        os.write(2, f"\nasyncrl: {name} received: finishing the current step, then checkpoint and exit "
                    f"(send it again to exit at once)\n".encode())


def kill_children() -> None:
    """SIGKILL every live child process this process started (rollout process, reward workers),
    so an immediate exit leaves none behind."""
    for child in multiprocessing.active_children():
        try:
            child.kill()
        except (OSError, ValueError):
            pass
