"""Math reward on real reference answers from the data sets that ship in asyncrl/data/sets."""
import json
import random
from pathlib import Path

import pytest

from asyncrl.data.sources import SHIPPED_DATA
from asyncrl.rewards.math import extract_gsm8k, math_reward

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)
needs_data = pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")


def _rows(relative: str) -> list[dict]:
    with open(DATA / relative, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _last_boxed(text: str) -> str:
    """The content of the last \\boxed{...}, braces balanced."""
    start = text.rindex("\\boxed{") + len("\\boxed{")
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    return text[start:end - 1]


def _gsm8k_sample() -> list[dict]:
    rows = _rows("gsm8k/test.jsonl")
    return rows[:200] + random.Random(0).sample(rows[200:], 50)


@needs_data
def test_gsm8k_solutions_score_one_against_their_answer():
    for row in _gsm8k_sample():
        answer = extract_gsm8k(row["answer"])
        assert math_reward(row["question"], row["answer"], answer=answer) == 1.0, row["answer"]
        # the full solution works as the reference too
        assert math_reward(row["question"], f"so \\boxed{{{answer}}}", answer=row["answer"]) == 1.0


@needs_data
def test_gsm8k_perturbed_answers_score_zero():
    for row in _gsm8k_sample():
        answer = extract_gsm8k(row["answer"])
        wrong = row["answer"].rsplit("####", 1)[0] + f"#### {int(float(answer)) + 1}"
        assert math_reward(row["question"], wrong, answer=answer) == 0.0, wrong


@needs_data
@pytest.mark.parametrize("name", ["math_eval/aime24.jsonl", "math_eval/amc23.jsonl"])
def test_competition_answers_score_one_and_perturbed_zero(name):
    for row in _rows(name):
        answer = row["answer"]  # str for AIME, float for AMC
        assert math_reward(row["problem"], f"The answer is $\\boxed{{{answer}}}$.", answer=answer) == 1.0
        wrong = float(answer) + 1
        assert math_reward(row["problem"], f"The answer is $\\boxed{{{wrong:g}}}$.", answer=answer) == 0.0


@needs_data
def test_minerva_solutions_score_one_against_their_boxed_answer():
    rows = _rows("math_eval/minerva_math.jsonl")
    failures = [row["solution"][-120:] for row in rows
                if math_reward(row["problem"], row["solution"], answer=_last_boxed(row["solution"])) != 1.0]
    assert failures == []


@pytest.mark.parametrize("gold,response", [
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("1/2", "so the answer is \\boxed{0.5}"),
    ("\\frac12", "#### 0.5"),
    ("1000", "#### 1,000"),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}"),
    ("(1, 2]", "\\boxed{(1, 2]}"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("50\\%", "\\boxed{50}"),
])
def test_equivalent_forms_score_one(gold, response):
    assert math_reward("", response, answer=gold) == 1.0


@pytest.mark.parametrize("gold,response", [
    ("(1, 2]", "\\boxed{[1, 2]}"),
    ("\\{1, 2\\}", "\\boxed{\\{1, 3\\}}"),
    ("0.5", "\\boxed{\\frac{1}{3}}"),
])
def test_different_answers_score_zero(gold, response):
    assert math_reward("", response, answer=gold) == 0.0


@pytest.mark.parametrize("response", [
    "", "   ", "garbage " * 50_000, "\\boxed{", "}}}{{\\frac{{{", "\x00\xff", "#### ", "\\boxed{}" * 1000,
])
def test_garbage_responses_score_zero_without_raising(response):
    assert math_reward("", response, answer="3") == 0.0


def test_missing_reference_answer_is_a_loud_error():
    with pytest.raises(ValueError, match="reference answer"):
        math_reward("", "\\boxed{1}", answer=None)


def test_works_off_the_main_thread():
    """math-verify's signal timeouts break in threads; the reward must not."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        assert list(ex.map(lambda r: math_reward("", r, answer="0.5"), ["\\boxed{1/2}", "#### 2"])) == [1.0, 0.0]


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("0123456789+-*/^{}()[]\\$#.,= abcfrxqtsboxed\n")) | st.characters(),
               max_size=200))
def test_any_text_scores_zero_or_one(response):
    assert math_reward("", response, answer="\\frac{1}{2}") in (0.0, 1.0)
