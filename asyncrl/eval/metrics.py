"""Sampling metrics of k responses per prompt: mean@k, pass@k (unbiased), maj@k.

For one prompt with n samples of which c are correct:

    mean@n = c / n
    pass@k = 1 - C(n-c, k) / C(n, k)      (Chen et al. 2021, "Evaluating Large Language
                                           Models Trained on Code", eq. 1), k <= n
    maj@n  = 1 if the most frequent final answer is correct, else 0; a tie between
             answers gives the fraction of the tied answers that are correct (the
             expected score of breaking the tie at random); no answer at all gives 0

and each benchmark number is the mean over prompts.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: the chance that k of the n samples, drawn without
    replacement, include a correct one. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i),
    which equals 1 - C(n-c,k)/C(n,k) without forming huge binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> float:
    """maj@n of one prompt. ``answers[i]`` is sample i's normalised final answer (None:
    none found, no vote); an answer's verdict is that of its first sample."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} verdicts")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    verdict = {}
    for answer, ok in zip(answers, correct):
        verdict.setdefault(answer, bool(ok))
    return sum(verdict[a] for a in tied) / len(tied)


def report_ks(k: int) -> list[int]:
    """The k of the pass@k columns: powers of two below k, and k itself."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]
