"""Code-execution reward: run the response's program against tests in the sandbox.

Fields the reward reads from the dataset row:
  * ``tests``: a list of test cases, each either
      - a string of Python (``"assert add(1, 2) == 3"``) run after the program in the
        program's namespace; it passes when it raises nothing, or
      - ``{"input": "...", "output": "..."}``: the program is run with that stdin and
        passes when its stdout equals ``output`` (trailing whitespace per line ignored);
    or a single string (one test; HumanEval's ``check`` function plus a call);
  * ``code_prefix`` (optional): prepended to the program (HumanEval's prompt when the
    model writes only the function body).

All tests run in one sandboxed process (one interpreter start per response, not
per test); each test gets ``per_test_timeout_s`` via SIGALRM, and results stream to
the report channel so a program that hangs in test 3 still gets credit for 1 and 2.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

from asyncrl.rewards.sandbox import SandboxLimits, SandboxResult, run_python

Test = Union[str, dict]
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs inside the sandbox as main.py. It reads the candidate and the tests from
# files, so no quoting of user text into source is needed.
_DRIVER = r'''
import io, json, os, signal, sys
report = os.fdopen(int(os.environ["ASYNCRL_REPORT_FD"]), "w", buffering=1)
candidate = open("candidate.py", encoding="utf-8").read()
spec = json.load(open("tests.json", encoding="utf-8"))

def on_alarm(signum, frame):
    raise TimeoutError("test timed out")

signal.signal(signal.SIGALRM, on_alarm)

def emit(index, passed, error=""):
    report.write(json.dumps({"test": index, "passed": passed, "error": error[-500:]}) + "\n")

def run_source(stdin_text):
    """Execute the candidate as __main__ with the given stdin; return its stdout."""
    real_in, real_out = sys.stdin, sys.stdout
    captured = io.BytesIO()  # binary underneath, so sys.stdout.buffer works too
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_text.encode()), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(captured, encoding="utf-8", write_through=True)
    try:
        try:
            exec(compile(candidate, "solution.py", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        sys.stdout.flush()
        return captured.getvalue().decode("utf-8", errors="replace")
    finally:
        sys.stdin, sys.stdout = real_in, real_out

def same_output(got, want):
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]
    return norm(got) == norm(want)

namespace = None
for index, test in enumerate(spec["tests"]):
    signal.setitimer(signal.ITIMER_REAL, spec["per_test_timeout_s"])
    try:
        if isinstance(test, dict):
            got = run_source(str(test.get("input", "")))
            ok = same_output(got, str(test.get("output", "")))
            emit(index, ok, "" if ok else f"expected {test.get('output')!r}, got {got[:200]!r}")
        else:
            if namespace is None:  # define the program once for all assert tests
                namespace = {"__name__": "solution"}
                exec(compile(candidate, "solution.py", "exec"), namespace)
            exec(compile(test, f"test_{index}.py", "exec"), dict(namespace))
            emit(index, True)
    except BaseException as e:
        emit(index, False, f"{type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
'''


def extract_code(response: str) -> str:
    """The last fenced code block (```python ... ```) or, if none, the whole text."""
    blocks = _FENCE.findall(response or "")
    return blocks[-1] if blocks else (response or "")


def run_tests(
    program: str, tests: list[Test], limits: Optional[SandboxLimits] = None,
    per_test_timeout_s: float = 5.0,
) -> tuple[list[bool], SandboxResult]:
    """Run ``program`` against ``tests`` in one sandbox; per-test pass flags.

    A test that never reported (the process died or timed out first) failed.
    """
    files = {
        "candidate.py": program,
        "tests.json": json.dumps({"tests": list(tests), "per_test_timeout_s": per_test_timeout_s}),
    }
    result = run_python(_DRIVER, limits=limits, files=files)
    if result.status == "sandbox_error":  # not the program's fault: a recorded failure
        raise RuntimeError(f"code sandbox failed to start: {result.stderr[-1000:]}")
    passed = [False] * len(tests)
    for line in result.report:
        try:
            record = json.loads(line)
            index = int(record["test"])
        except (ValueError, KeyError, TypeError):
            continue  # the program wrote to the channel itself: ignore it
        if 0 <= index < len(tests):
            passed[index] = record.get("passed") is True
    return passed, result


def code_reward(
    prompt: str, response: str, tests: Union[Test, list[Test], None] = None,
    code_prefix: str = "", all_or_nothing: bool = False, timeout_s: float = 10.0,
    per_test_timeout_s: float = 5.0, memory_mb: int = 1024, **fields: Any,
) -> float:
    """Fraction of ``tests`` the program in ``response`` passes (1.0 / 0.0 with
    ``all_or_nothing``). Raises ValueError when the row has no tests (a data bug)."""
    if tests is None or tests == [] or tests == "":
        raise ValueError("code reward: the example has no 'tests' field")
    test_list = [tests] if isinstance(tests, (str, dict)) else list(tests)
    program = (code_prefix or "") + extract_code(response)
    limits = SandboxLimits(wall_time_s=timeout_s, cpu_time_s=max(1, int(timeout_s)), memory_mb=memory_mb)
    passed, _ = run_tests(program, test_list, limits, per_test_timeout_s)
    fraction = sum(passed) / len(passed)
    return float(fraction == 1.0) if all_or_nothing else fraction
