"""Benchmark evaluation: k samples per prompt through any rollout backend, scored by the
configured rewards, summarised as mean@k, pass@k and maj@k (see ``eval.metrics``).

    examples ──encode──► backend.generate(n=k) ──► reward (pool) ──► correct = the verifier (first reward) >= 1
                                              └──► final_answer ──► majority vote

``evaluate_examples`` needs only the rollout protocol (``generate``), so the HF backend,
the asyncrl engine or a mock in a test all work.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from asyncrl.data.sources import grade_completions
from asyncrl.eval.answers import final_answer
from asyncrl.eval.metrics import majority_correct, pass_at_k, report_ks
from asyncrl.types import Example, SamplingParams

METRICS = ("mean", "pass", "maj")


@dataclass
class PromptResult:
    """One prompt's k samples: their scores, verdicts and normalised final answers."""

    uid: str
    scores: list[float]
    correct: list[bool]
    answers: list[Optional[str]]
    responses: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        return sum(self.correct)


def evaluate_examples(backend, encode: Callable[[Example], list[int]], examples: Sequence[Example],
                      reward_fn, params: SamplingParams, batch_size: int = 64) -> list[PromptResult]:
    """Generate ``params.n`` samples per example, ``batch_size`` prompts per call, and score them."""
    results = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        for example, output in zip(chunk, backend.generate([encode(ex) for ex in chunk], params)):
            scores, correct = grade_completions(reward_fn, example, output.completions)  # the verifier's verdict
            texts = [c.text for c in output.completions]
            results.append(PromptResult(example.uid, scores, [c >= 1.0 for c in correct],
                                        [final_answer(t) for t in texts], texts,
                                        [c.finish_reason for c in output.completions]))
    return results


def summarize(results: Sequence[PromptResult], k: int, metrics: Sequence[str] = METRICS) -> dict[str, float]:
    """Benchmark numbers: the mean over prompts of each per-prompt metric.

    ``mean@k`` (the mean verdict of all samples), ``pass@j`` for j in 1, 2, 4, ... k,
    ``maj@k``; plus ``num_prompts``.
    """
    if not results:
        raise ValueError("nothing to summarise: no prompts were evaluated")
    out: dict[str, float] = {"num_prompts": float(len(results))}
    count = len(results)
    if "mean" in metrics:
        out[f"mean@{k}"] = sum(r.num_correct / r.n for r in results) / count
    if "pass" in metrics:
        for j in report_ks(k):
            out[f"pass@{j}"] = sum(pass_at_k(r.n, r.num_correct, j) for r in results) / count
    if "maj" in metrics:
        out[f"maj@{k}"] = sum(majority_correct(r.answers, r.correct) for r in results) / count
    return out


def result_record(result: PromptResult) -> dict:
    """A jsonl row of one prompt (for eval_samples.jsonl)."""
    return {**asdict(result), "num_correct": result.num_correct}
