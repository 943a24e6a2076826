"""StepGate: a control call waits for the step in flight only; steps yield to waiting controls."""
from __future__ import annotations

import threading
import time

from asyncrl.engine.step_gate import StepGate

STEP_S = 0.004


def test_control_waits_for_at_most_the_step_in_flight():
    """A thread runs steps back to back (a generate loop: release, re-take at once); each control
    call gets in after at most the step in flight (here 4 ms; the bar leaves room for a busy CI)."""
    gate, stop, steps = StepGate(), threading.Event(), []

    def loop():
        while not stop.is_set():
            with gate.step():
                time.sleep(STEP_S)
                steps.append(1)

    thread = threading.Thread(target=loop)
    thread.start()
    waits = []
    try:
        for _ in range(10):
            time.sleep(STEP_S / 2)
            with gate.control() as waited:
                waits.append(waited)
                before = len(steps)
                time.sleep(STEP_S)
                assert len(steps) == before  # no step ran while the control held the gate
    finally:
        stop.set()
        thread.join()
    assert max(waits) < 10 * STEP_S and len(steps) > 0


def test_reentrant_step_inside_control():
    """A control call may run a step itself (same thread): no deadlock on its own hold."""
    gate = StepGate()
    with gate.control():
        with gate.step():
            with gate.control() as waited:
                assert waited < 0.1
