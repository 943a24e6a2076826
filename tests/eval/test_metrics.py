"""pass@k against hand values and a brute-force count over k-subsets; maj@k with ties;
final-answer extraction for the vote."""
import itertools
import math

import pytest

from asyncrl.eval.answers import final_answer, last_boxed
from asyncrl.eval.metrics import majority_correct, pass_at_k, report_ks


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: the fraction of k-subsets of n samples (c correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k,expected", [
    (10, 3, 1, 0.3),                 # pass@1 = c/n
    (10, 3, 5, 1 - 21 / 252),        # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (4, 1, 2, 0.5),                  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 0, 3, 0.0),                  # no correct sample
    (5, 3, 3, 1.0),                  # n - c = 2 < k = 3: every 3-subset holds a correct one
    (16, 1, 16, 1.0),
    (8, 2, 4, 1 - 15 / 70),          # 1 - C(6,4)/C(8,4)
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_brute_force_and_the_binomial_formula():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                closed = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_vote_with_ties_and_abstentions():
    # "1" has 2 votes, "2" one: the majority answer "1" is correct
    assert majority_correct(["1", "2", "1"], [True, False, True]) == 1.0
    # the majority is wrong even though one sample is right (pass@3 would be 1)
    assert majority_correct(["5", "5", "7"], [False, False, True]) == 0.0
    # a tie between "1" (right) and "2" (wrong): half credit, the expected score of a coin flip
    assert majority_correct(["1", "2", "2", "1"], [True, False, False, True]) == 0.5
    # a three-way tie with one right answer: 1/3
    assert majority_correct(["a", "b", "c"], [False, True, False]) == pytest.approx(1 / 3)
    # no answer does not vote: "3" wins with one vote against two abstentions
    assert majority_correct([None, None, "3"], [False, False, True]) == 1.0
    assert majority_correct([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError):
        majority_correct(["1"], [True, False])


def test_report_ks():
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(6) == [1, 2, 4, 6]


def test_final_answer_normalises_equal_answers_together():
    assert final_answer("so 3 + 4 = 7\n#### 1,000") == "1000"
    assert final_answer("thus $\\boxed{\\dfrac{1}{2}}$.") == final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert final_answer("I get 3.50.") == final_answer("\\boxed{3.5}") == "3.5"
    assert final_answer("\\boxed{27.0}") == "27"
    assert final_answer("no numbers here") is None
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}} and more") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
