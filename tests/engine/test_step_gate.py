"""StepGate: a control call waits for the step in flight only; steps yield to waiting controls."""
from __future__ import annotations

import threading
import time

from asyncrl.engine.step_gate import StepGate

STEP_S = 0.004


def test_control_waits_for_at_most_the_step_in_flight():
    """A thread runs steps back to back (a generate loop: release, re-take at once). Each control
    call gets in after at most the step in flight (and one that passed the gate as it arrived):
    no third step starts while it waits, none runs while it holds the gate, and it reports the
    seconds it waited."""
    gate, stop, started, finished = StepGate(), threading.Event(), [], []

    def loop():
        while not stop.is_set():
            with gate.step():
                started.append(1)
                time.sleep(STEP_S)
                finished.append(1)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for _ in range(10):
            time.sleep(STEP_S / 2)
            before = len(started)
            with gate.control() as waited:
                assert len(started) - before <= 2 and len(started) == len(finished)
                time.sleep(STEP_S)
                assert len(started) == len(finished)  # no step ran while the control held the gate
                assert 0 <= waited < 60.0
    finally:
        stop.set()
        thread.join()
    assert len(started) > 0


def test_reentrant_step_inside_control():
    """A control call may run a step itself (same thread): no deadlock on its own hold."""
    gate = StepGate()
    with gate.control():
        with gate.step():
            with gate.control() as waited:
                assert waited < 0.1
