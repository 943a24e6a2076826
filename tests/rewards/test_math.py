"""Math reward on real reference answers from the data sets that ship in asyncrl/data/sets."""
import json
import random
import time
from pathlib import Path

import pytest

from asyncrl.data.sources import SHIPPED_DATA
from asyncrl.eval.answers import last_boxed
from asyncrl.rewards.math import extract_gsm8k, math_reward

DATA = SHIPPED_DATA  # the sets that ship inside the package (asyncrl/data/sets)
needs_data = pytest.mark.skipif(not DATA.exists(), reason="asyncrl/data/sets not present")


def _rows(relative: str) -> list[dict]:
    with open(DATA / relative, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


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
                if math_reward(row["problem"], row["solution"], answer=last_boxed(row["solution"])) != 1.0]
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


# The cases of issue 17: what the policy could be rewarded for, and must not be.
@pytest.mark.parametrize("gold,response,score", [
    ("5", "First I get \\boxed{3}. Wait, that is wrong. Recomputing: \\boxed{5}", 1.0),  # self-correction
    ("3", "First I get \\boxed{3}. Wait, that is wrong. Recomputing: \\boxed{5}", 0.0),
    ("5", "the answer is 5 or 6", 0.0),                       # two different final answers
    ("5", "#### 5 or 6", 0.0),
    ("5", "\\boxed{5} or \\boxed{6}", 0.0),
    ("\\{3, 5\\}", "\\boxed{3} or \\boxed{5}", 1.0),     # ... which is right when the answer is that set
    ("5", "I added 2 and 3 and got 5 apples, I think", 0.0),  # no final answer: the last number is not one
    ("5", "#### Final Answer\nSo \\boxed{5}", 1.0),            # markdown headings are not GSM8K markers
    ("5", "#### Step 1\nWe add.\n#### Step 2\n\\boxed{5}", 1.0),
    ("-5", "The answer is \u22125", 1.0),                     # Unicode minus outside a box
    ("1000", "\\boxed{1\u202f000}", 1.0),                   # narrow no-break space as thousands separator
])
def test_issue_17_cases(gold, response, score):
    assert math_reward("", response, answer=gold) == score


def test_last_number_fallback_is_opt_in():
    assert math_reward("", "we add 2 and 3 to get 5", answer="5") == 0.0
    assert math_reward("", "we add 2 and 3 to get 5", answer="5", last_number_fallback=True) == 1.0


@pytest.mark.parametrize("response", [
    "\\boxed{(10!)!}", "\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9^9}}}", "\\boxed{(10^{100})!}", "\\boxed{x^{10^{12}}}",
])
def test_pathological_answers_cost_at_most_about_half_a_second(response):
    math_reward("", "\\boxed{5}", answer="5")  # math-verify imported and warm
    start = time.process_time()
    assert math_reward("", response, answer="5") == 0.0
    assert time.process_time() - start < 1.0  # a 0.5 CPU-second budget (plus extraction, screening)


def test_pathological_answers_are_screened_off_the_main_thread_too():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        start = time.perf_counter()
        assert ex.submit(math_reward, "", "\\boxed{(10!)!}", answer="5").result() == 0.0
        assert time.perf_counter() - start < 5  # no signal timer here: the cost screen refused it


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
