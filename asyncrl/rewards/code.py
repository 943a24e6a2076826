"""Code-execution reward: the response's program in the sandbox, the tests outside it.

Fields the reward reads from the dataset row:
  * ``tests``: a list of test cases, each either
      - a string of Python (``"assert add(1, 2) == 3"``); it passes when it raises nothing, or
      - ``{"input": "...", "output": "..."}``: the program run with that stdin passes
        when its stdout equals ``output`` (trailing whitespace per line ignored);
    or a single string (one test; HumanEval's ``check`` function plus a call);
  * ``code_prefix`` (optional): prepended to the program (HumanEval's prompt when the
    model writes only the function body); it is also run, as trusted code, by the grader;
  * ``entry_point`` (optional): a name the tests must take from the candidate even if
    the prefix defines it.

Who does what (the verdict is never formed where the candidate runs):

    sandbox (candidate_server.py + the program)  <-- plain JSON values -->  grader.py
       runs the program's functions on request                            runs the tests,
       never sees a test                                                  compares, reports

The grader is a separate, unsandboxed process of the caller's (the tests are the
dataset's, trusted like the prompt); it receives only plain values from the sandbox,
so a returned object whose ``__eq__`` is always True, a patched ``json``/``exec`` in the
candidate's interpreter, or lines written to any descriptor cannot make a test pass.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from asyncrl.rewards import walls
from asyncrl.rewards.sandbox import SandboxLimits, SandboxResult, SandboxRun

Test = Union[str, dict]
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_GRADER = os.path.join(walls.STANDALONE, "grader.py")
_GRADER_MEMORY_BYTES = 2 * 1024 ** 3


@dataclass
class TestReport:
    """Per-test outcome of one program: ``passed[i]`` and, when it failed, ``errors[i]``.
    ``sandbox`` is what the candidate's run did (status, stderr, isolation)."""

    passed: list[bool]
    errors: list[str]
    sandbox: SandboxResult


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```) or, if none, the whole text."""
    blocks = _FENCE.findall(response or "")
    return blocks[-1] if blocks else (response or "")


def run_tests(program: str, tests: list[Test], limits: Optional[SandboxLimits] = None,
              per_test_timeout_s: float = 5.0, code_prefix: str = "",
              entry_point: Optional[str] = None) -> TestReport:
    """Run ``tests`` against ``program`` (which already includes any prefix).

    The program runs in one sandbox (one interpreter for all tests), the tests in one
    grader process; a test that reported nothing (deadline, crash) failed.
    """
    limits = limits or SandboxLimits()
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    env = {"ASYNCRL_REQUEST_FD": str(request_r), "ASYNCRL_REPLY_FD": str(reply_w)}
    try:
        sandbox = SandboxRun("candidate_server.py", {"candidate.py": program}, limits,
                             pass_fds=(request_r, reply_w), env=env, boot_main=True)
    finally:
        os.close(request_r)
        os.close(reply_w)
    spec = {"tests": list(tests), "per_test_timeout_s": per_test_timeout_s, "code_prefix": code_prefix or "",
            "entry_point": entry_point, "request_fd": request_w, "reply_fd": reply_r,
            "memory_bytes": _GRADER_MEMORY_BYTES}
    try:
        records = _grade(spec, limits.wall_time_s, sandbox)
    finally:
        os.close(request_w)
        os.close(reply_r)
    result = sandbox.wait()
    if result.status == "sandbox_error":  # not the program's fault: a recorded failure
        raise RuntimeError(f"code sandbox failed to start: {result.stderr[-1000:]}")
    passed, errors = [False] * len(tests), ["no verdict (the run ended first)"] * len(tests)
    for record in records:
        index = record.get("test")
        if isinstance(index, int) and 0 <= index < len(tests):
            passed[index] = record.get("passed") is True
            errors[index] = str(record.get("error", ""))
    return TestReport(passed, errors, result)


def _grade(spec: dict, wall_time_s: float, sandbox: SandboxRun) -> list[dict]:
    """Run the grader until it is done or the run's wall time is over; its verdicts."""
    grader = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", _GRADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, pass_fds=(spec["request_fd"], spec["reply_fd"]),
        start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    timer = threading.Timer(wall_time_s, lambda: (grader.kill(), sandbox.kill()))
    timer.start()
    records = []
    try:
        grader.stdin.write(json.dumps(spec).encode())
        grader.stdin.close()
        for line in grader.stdout:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("done"):
                break
            records.append(record)
    except (BrokenPipeError, OSError):
        pass
    finally:
        timer.cancel()
        grader.kill()
        grader.wait()
        sandbox.stop()  # the tests are over: the candidate's time is up
    return records


def code_reward(
    prompt: str, response: str, tests: Union[Test, list[Test], None] = None,
    code_prefix: str = "", all_or_nothing: bool = False, timeout_s: float = 10.0,
    per_test_timeout_s: float = 5.0, memory_mb: int = 1024, sandbox: str = "kernel",
    entry_point: Optional[str] = None, **fields: Any,
) -> float:
    """Fraction of ``tests`` the program in ``response`` passes (1.0 / 0.0 with
    ``all_or_nothing``). ``sandbox="weak"`` accepts the in-process sandbox where the
    kernel one is unavailable. Raises ValueError when the row has no tests (a data bug)."""
    if tests is None or tests == [] or tests == "":
        raise ValueError("code reward: the example has no 'tests' field")
    test_list = [tests] if isinstance(tests, (str, dict)) else list(tests)
    program = (code_prefix or "") + extract_code(response)
    limits = SandboxLimits(wall_time_s=timeout_s, cpu_time_s=max(1, int(timeout_s)), memory_mb=memory_mb,
                           isolation=sandbox)
    report = run_tests(program, test_list, limits, per_test_timeout_s, code_prefix, entry_point)
    fraction = sum(report.passed) / len(report.passed)
    return float(fraction == 1.0) if all_or_nothing else fraction
