"""The grader's rules for what is trusted (the prefix) and what is the candidate's."""
import ast

from asyncrl.rewards.standalone import grader


def test_stubs_are_functions_without_a_body():
    tree = ast.parse('def a(x):\n    """doc"""\n'
                     'def b(x):\n    import math\n    """doc"""\n'
                     'def c(x):\n    ...\n'
                     'def d(x):\n    """doc"""\n    return x\n')
    assert [grader.is_stub(node) for node in tree.body] == [True, True, True, False]


def test_trusted_namespace_runs_the_prefix_without_its_stubs():
    namespace, stubs, error = grader.trusted_namespace(
        'import math\ndef poly(xs, x):\n    return sum(xs)\ndef find_zero(xs: list):\n    """doc"""\n')
    assert "poly" in namespace and "math" in namespace and "find_zero" not in namespace
    assert stubs == {"find_zero"} and error == ""
    namespace, stubs, error = grader.trusted_namespace("def f(x):\n    return (")  # a fragment
    assert stubs == set() and "does not parse" in error


def test_used_names_are_the_globals_the_tests_read():
    tests = ["def check(candidate):\n    import math\n    assert candidate([1]) == poly([1], 2)\n"
             "    assert math.fabs(-1) == 1\n\ncheck(has_close)\n",
             "x = add(1, 2)\nassert x == 3\nassert [add(i, i) for i in range(3)] == [0, 2, 4]"]
    assert grader.used_names(tests) == {"has_close", "poly", "add", "range"}


def test_output_comparison_ignores_trailing_whitespace_only():
    assert grader.same_output("3 \n4\n\n", "3\n4")
    assert not grader.same_output("3 4", "3\n4")
