"""Code reward: fraction of tests passed, in the sandbox."""
import pytest

from asyncrl.rewards.code import code_reward, extract_code

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_correct_program_passes_all_tests():
    response = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert code_reward("p", response, tests=TESTS) == 1.0


def test_wrong_program_gets_partial_or_no_credit():
    # right only when a == 1... (1+2=3 passes; -1+1 -> -1*1=-1 fails; 2*2=4 passes)
    assert code_reward("p", "def add(a, b):\n    return a * b + (a == 1) * 1", tests=TESTS) == pytest.approx(2 / 3)
    assert code_reward("p", "def add(a, b):\n    return a * b + (a == 1)", tests=TESTS,
                       all_or_nothing=True) == 0.0
    assert code_reward("p", "this is not python(", tests=TESTS) == 0.0


def test_a_hanging_test_fails_alone():
    program = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b"
    assert code_reward("p", program, tests=TESTS, per_test_timeout_s=0.3) == pytest.approx(2 / 3)


def test_stdin_stdout_tests():
    program = "n = int(input())\nprint(n * 2)"
    tests = [{"input": "3\n", "output": "6"}, {"input": "5", "output": "10\n"}, {"input": "1", "output": "3"}]
    assert code_reward("p", program, tests=tests) == pytest.approx(2 / 3)


def test_humaneval_style_check_with_prefix():
    prefix = 'def incr_list(l: list):\n    """Return list with elements incremented by 1."""\n'
    test = "def check(candidate):\n    assert candidate([1, 2]) == [2, 3]\n\ncheck(incr_list)\n"
    assert code_reward("p", "    return [x + 1 for x in l]\n", tests=test, code_prefix=prefix) == 1.0
    assert code_reward("p", "    return l\n", tests=test, code_prefix=prefix) == 0.0


def test_hostile_programs_score_zero_and_the_caller_survives():
    hostile = [
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "x = bytearray(4 * 1024 ** 3)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
        "import os\nos._exit(0)",
    ]
    for program in hostile:
        assert code_reward("p", program, tests=TESTS, timeout_s=2.0, memory_mb=256) == 0.0


def test_forged_report_lines_are_ignored():
    program = ("import os\nf = os.fdopen(int(os.environ['ASYNCRL_REPORT_FD']), 'w')\n"
               "f.write('garbage\\n{\"test\": 99, \"passed\": true}\\n')\nf.flush()\n"
               "def add(a, b):\n    return -999")
    assert code_reward("p", program, tests=TESTS) == 0.0


def test_extract_code_and_missing_tests():
    assert extract_code("```py\na=1\n```\ntext\n```python\nb=2\n```") == "b=2\n"
    assert extract_code("plain = 1") == "plain = 1"
    with pytest.raises(ValueError, match="tests"):
        code_reward("p", "x = 1", tests=None)
