"""Synthetic tasks: deterministic generation, held-out split, exact checkers on any output."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from asyncrl.data.tasks import ArithmeticTask, CountdownTask
from asyncrl.data.tasks.countdown import evaluate


def test_arithmetic_is_deterministic_and_held_out_never_trained():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert [e.prompt for e in a.eval_examples()] == [e.prompt for e in b.eval_examples()]
    held_out = {e.prompt for e in a.eval_examples()}
    assert len(held_out) == 200
    train = [e.prompt for e in itertools.islice(a.train_stream(seed=0), 5000)]
    assert not held_out & set(train)


def test_arithmetic_operands_draw_digit_count_first():
    task = ArithmeticTask(seed=0, min_digits=1, max_digits=3)
    examples = list(itertools.islice(task.train_stream(seed=1), 3000))
    one_digit = sum(len(e.prompt.split("+")[0]) == 1 for e in examples) / len(examples)
    assert 0.25 < one_digit < 0.42  # about 1/3, not 10/1000 as a uniform value draw would give


@pytest.mark.parametrize("op, expected", [("+", "579"), ("-", "-333"), ("*", "56088")])
def test_arithmetic_answers(op, expected):
    task = ArithmeticTask(seed=0, operations=(op,))
    assert str(eval(task.eval_examples()[0].prompt[:-1])) == task.eval_examples()[0].answer
    assert task.score(expected, answer=expected) == 1.0


def test_arithmetic_checker_requires_exact_answer_and_eos():
    task = ArithmeticTask(seed=0)
    assert task.score("42", answer="42") == 1.0
    assert task.score(" 42 ", answer="42") == 1.0
    assert task.score("42", answer="42", finish_reason="length") == 0.0  # cut off before EOS
    for garbage in ["", "4", "420", "42+1", "forty-two", "\x00", "4" * 10_000, None]:
        assert task.score(garbage, answer="42") == 0.0


def test_countdown_demonstrations_are_correct():
    task = CountdownTask(seed=1)
    for ex in task.eval_examples():
        assert task.score(ex.answer, **ex.fields) == 1.0, ex


def test_countdown_checker():
    fields = {"numbers": [3, 7, 25], "target": 46}
    task = CountdownTask(seed=0)
    assert task.score("25+3*7", **fields) == 1.0
    assert task.score("(25+3*7)", **fields) == 1.0
    assert task.score("<answer>25+7*3</answer>", **fields) == 1.0
    assert task.score("<answer>25+7*3", **fields) == 1.0  # unbalanced: no closing tag
    assert task.score("25+7*3</answer>", **fields) == 1.0  # unbalanced: no opening tag
    assert task.score("25+25-4", **fields) == 0.0  # 25 used twice, 4 not given
    assert task.score("25+3*7", numbers=[3, 7, 25], target=47) == 0.0
    assert task.score("25+3*7", **fields, finish_reason="length") == 0.0
    for garbage in ["", "((((", "25+", "__import__('os')", "25**3", "-25+71", "1/0", "x" * 100_000,
                    "<answer></answer>", "</answer><answer>", "7" * 70]:
        assert task.score(garbage, **fields) == 0.0


def test_countdown_division_is_exact():
    assert evaluate("7/2*2") == (7, [7, 2, 2])
    assert CountdownTask(seed=0).score("25/5+3", numbers=[25, 5, 3], target=8) == 1.0


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_checkers_never_raise_on_arbitrary_text(text):
    assert ArithmeticTask(seed=0, num_eval=5).score(text, answer="12") in (0.0, 1.0)
    assert CountdownTask(seed=0, num_eval=5).score(text, numbers=[1, 2, 3], target=6) in (0.0, 1.0)
