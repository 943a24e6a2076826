"""Code reward: fraction of tests passed; the program in the sandbox, the tests in the grader."""
import pytest

from asyncrl.rewards.code import code_reward, extract_code, run_tests

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
pytestmark = pytest.mark.usefixtures("kernel_sandbox")


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


def test_stdin_stdout_tests_are_compared_outside():
    program = "n = int(input())\nprint(n * 2)"
    tests = [{"input": "3\n", "output": "6"}, {"input": "5", "output": "10\n"}, {"input": "1", "output": "3"}]
    assert code_reward("p", program, tests=tests) == pytest.approx(2 / 3)
    report = run_tests(program, tests[2:])
    assert report.passed == [False] and report.errors[0] == "expected '3', got '2\\n'"


def test_humaneval_style_check_with_prefix():
    """The prefix's docstring-only function is the stub the response completes: the
    tests get the candidate's; its helper functions stay the trusted ones."""
    prefix = ('def shift(s):\n    return s[1:] + s[:1]\n\n'
              'def unshift(s: str):\n    """Inverse of shift."""\n')
    test = "def check(candidate):\n    assert candidate(shift('abc')) == 'abc'\n\ncheck(unshift)\n"
    assert code_reward("p", "    return s[-1:] + s[:-1]\n", tests=test, code_prefix=prefix) == 1.0
    assert code_reward("p", "    return s\n", tests=test, code_prefix=prefix) == 0.0
    # redefining the trusted helper in the response does not change what the tests call
    cheat = "    return s\n\ndef shift(s):\n    return s\n"
    assert code_reward("p", cheat, tests=test, code_prefix=prefix) == 0.0


def test_classes_and_methods_through_handles():
    program = ("class Solution:\n    def __init__(self):\n        self.calls = 0\n"
               "    def two_sum(self, nums, target):\n        self.calls += 1\n"
               "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
               "                return [seen[target - x], i]\n            seen[x] = i\n")
    tests = ["s = Solution()\nassert s.two_sum([2, 7, 11], 9) == [0, 1]\nassert s.calls == 1",
             "assert Solution().two_sum((3, 3), 6) == [0, 1]"]
    assert code_reward("p", program, tests=tests) == 1.0


def test_in_place_changes_to_arguments_reach_the_tests():
    program = "def rotate(xs):\n    xs[:] = xs[-1:] + xs[:-1]\n"
    assert code_reward("p", program, tests=["xs = [1, 2, 3]\nrotate(xs)\nassert xs == [3, 1, 2]"]) == 1.0


def test_candidate_exceptions_arrive_as_builtin_exceptions():
    program = "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n"
    test = "try:\n    root(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    raise AssertionError"
    assert code_reward("p", program, tests=[test, "assert root(4) == 2"]) == 1.0


def test_objects_that_are_not_plain_values_decide_nothing():
    """An object comes back as an opaque stand-in: equal only to itself, no truth value."""
    program = ("class Yes:\n    def __eq__(self, o): return True\n    def __bool__(self): return True\n"
               "def f():\n    return Yes()\n")
    report = run_tests(program, ["assert f() == 3", "assert f()", "assert not (f() != 3)"])
    assert report.passed == [False, False, False]
    assert "no truth value" in report.errors[1]


def test_values_that_cannot_cross_fail_the_test():
    report = run_tests("def apply(f, x):\n    return f(x)\n", ["assert apply(lambda v: v + 1, 1) == 2"])
    assert report.passed == [False] and "only plain values" in report.errors[0]


def test_entry_point_is_taken_from_the_candidate():
    prefix = "def answer():\n    return 0\n"  # not a stub: the entry point says whose it is
    program = prefix + "def answer():\n    return 42\n"
    assert code_reward("p", "def answer():\n    return 42\n", tests=["assert answer() == 42"],
                       code_prefix=prefix) == 0.0
    assert run_tests(program, ["assert answer() == 42"], code_prefix=prefix, entry_point="answer").passed == [True]


def test_weak_sandbox_when_chosen_explicitly():
    """Runs where the throw-away uid can read asyncrl's scripts; elsewhere (a root caller with the
    checkout under a mode-700 home) the sandbox refuses, naming the directory."""
    import os

    from asyncrl.rewards import walls
    from asyncrl.rewards.sandbox import SandboxUnavailable

    if os.geteuid() == 0 and walls.weak_mode_blocker("candidate_server.py"):
        with pytest.raises(SandboxUnavailable, match="weak sandbox unavailable: .* cannot read /"):
            code_reward("p", "def add(a, b):\n    return a + b", tests=TESTS, sandbox="weak")
        return
    assert code_reward("p", "def add(a, b):\n    return a + b", tests=TESTS, sandbox="weak") == 1.0


def test_extract_code_and_missing_tests():
    assert extract_code("```py\na=1\n```\ntext\n```python\nb=2\n```") == "b=2\n"
    assert extract_code("plain = 1") == "plain = 1"
    with pytest.raises(ValueError, match="tests"):
        code_reward("p", "x = 1", tests=None)
