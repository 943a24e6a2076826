"""Scored rollout groups, and DAPO's dynamic sampling over them (arXiv 2503.14476, verl recipe).

A *group* is one prompt with its n completions and their rewards. Dynamic sampling
drops the groups whose metric is constant (all correct or all wrong: zero GRPO
advantage, pure dilution), and generates further rounds of ``target`` prompts until
``target`` groups survive; the result is then truncated, in order, to exactly
``target`` groups. Advantages are computed afterwards, on the kept groups only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from asyncrl.algorithms import filter_groups
from asyncrl.types import Example, RequestOutput


@dataclass
class ScoredGroups:
    """Groups of one or more rollout rounds. Invariant: every list has one entry per prompt,
    and ``scores[g]`` / ``correct[g]`` have one entry per completion of ``outputs[g]``.

    scores     shaped reward (task reward + overlong penalty): what the advantage sees
    correct    1.0 where the task reward is >= 1 (accuracy; DAPO's "acc" metric)
    baselines  reward of one greedy rollout per prompt (remax), else None
    """

    examples: list[Example]
    outputs: list[RequestOutput]
    scores: list[list[float]]
    correct: list[list[float]]
    baselines: Optional[list[float]] = None

    def __len__(self) -> int:
        return len(self.outputs)

    def take(self, index: list[int]) -> "ScoredGroups":
        pick = lambda items: [items[i] for i in index]
        return ScoredGroups(pick(self.examples), pick(self.outputs), pick(self.scores), pick(self.correct),
                            pick(self.baselines) if self.baselines is not None else None)

    @staticmethod
    def concat(parts: list["ScoredGroups"]) -> "ScoredGroups":
        join = lambda name: [item for part in parts for item in getattr(part, name)]
        baselines = join("baselines") if parts and parts[0].baselines is not None else None
        return ScoredGroups(join("examples"), join("outputs"), join("scores"), join("correct"), baselines)

    def flat(self, name: str) -> list[float]:
        """``scores`` or ``correct`` flattened prompt-major (the TrainBatch row order)."""
        return [value for group in getattr(self, name) for value in group]


# metric name (algorithm.filter_groups.metric) -> the ScoredGroups field it reads
FILTER_METRICS = {"acc": "correct", "score": "scores"}


def varied_groups(groups: ScoredGroups, metric: str) -> list[int]:
    """Indices of the groups whose ``metric`` varies (or that have a single member)."""
    table = getattr(groups, FILTER_METRICS[metric])
    sizes = torch.tensor([len(row) for row in table])
    group_ids = torch.arange(len(table)).repeat_interleave(sizes)
    keep_rows = filter_groups(torch.tensor([v for row in table for v in row], dtype=torch.float64), group_ids)
    first_rows = torch.cumsum(sizes, 0) - sizes
    return [g for g in range(len(table)) if bool(keep_rows[first_rows[g]])]


class DynamicSamplingCapError(RuntimeError):
    """Raised when ``max_num_gen_batches`` rounds did not yield enough varied groups."""


def collect_varied_groups(generate_round: Callable[[int], ScoredGroups], target: int, metric: str,
                          max_rounds: int) -> tuple[ScoredGroups, ScoredGroups, dict[str, float]]:
    """Generate rounds until ``target`` varied groups are kept; return (kept, generated, metrics).

    ``generate_round(r)`` produces round r (r = 0, 1, ...). ``kept`` has exactly ``target``
    groups, in generation order; ``generated`` is every group of every round (for reward
    metrics, which must describe the policy, not the filtered batch). ``max_rounds`` 0 is
    unlimited; otherwise reaching it short of ``target`` raises DynamicSamplingCapError.
    """
    kept, generated = [], []
    while sum(len(part) for part in kept) < target:
        if max_rounds and len(generated) >= max_rounds:
            have = sum(len(part) for part in kept)
            raise DynamicSamplingCapError(
                f"dynamic sampling: algorithm.filter_groups.max_num_gen_batches={max_rounds} rollout rounds kept "
                f"only {have} of the {target} groups needed (trainer.prompts_per_step); the others had a constant "
                f"'{metric}' (all correct or all wrong). Raise max_num_gen_batches (0 = unlimited), use "
                "filter_groups.metric=score, lower trainer.prompts_per_step, or set filter_groups.enable=false.")
        batch = generate_round(len(generated))
        generated.append(batch)
        kept.append(batch.take(varied_groups(batch, metric)))
    all_groups = ScoredGroups.concat(generated)
    n_kept = sum(len(part) for part in kept)
    metrics = {"dynamic_sampling/rounds": float(len(generated)),
               "dynamic_sampling/kept_group_fraction": n_kept / max(1, len(all_groups))}
    return ScoredGroups.concat(kept).take(list(range(target))), all_groups, metrics
