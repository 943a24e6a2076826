"""The engine-vs-trainer log-prob gap: how far the rollout engine's sampling log-probs are
from the trainer's log-probs of the same tokens under the same weights.

A gap near zero says the engine runs the trainer's weights and numerics (same dtype: < 1e-3
nats/token in fp32); a growing gap is the classic silent failure of RL stacks (stale weights,
a kernel or dtype mismatch, a tokenizer mismatch). The trainer measures it every step: from the
recomputed old log-probs when it has them, else from the update's own first forward, which
runs before the optimizer step and therefore on the weights that generated the batch.
"""
from __future__ import annotations

from typing import Optional

import torch


class LogprobGap:
    """Accumulates |trainer − engine| log-prob differences over response tokens.

    Invariant: ``total / tokens`` is the mean over every response token added since the last
    ``reset`` (token-weighted across micro-batches), and ``max`` the largest single difference.

    ``add`` keeps the three on the device (0-dim float64, on the first tensors' device) and
    reads nothing back: it runs between the update's forward and its backward, where a host
    read would leave the GPU idle. :meth:`totals` and :meth:`metrics` read them (one sync).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums: Optional[torch.Tensor] = None  # [3]: total, tokens, max

    @torch.no_grad()
    def add(self, trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """All [B, L]; ``mask`` is 1 on response tokens (padding contributes nothing)."""
        if trainer_logprobs.numel() == 0:
            return
        keep = mask.to(trainer_logprobs.device).bool()
        diff = (trainer_logprobs.detach().float() - engine_logprobs.to(trainer_logprobs.device).float()).abs()
        # 0 off the mask (|diff| >= 0, so the max is the masked max; where, not *, so a padded
        # inf/NaN stays out); the float32 sum accumulates in float64 as the host floats did
        diff = torch.where(keep, diff, diff.new_zeros(()))
        part = torch.stack([diff.sum().double(), keep.sum().double(), diff.max().double()])
        if self._sums is None:
            self._sums = part
        else:
            self._sums = torch.cat([self._sums[:2] + part[:2], torch.maximum(self._sums[2:], part[2:])])

    def totals(self) -> tuple[float, float, float]:
        """(total, tokens, max) as floats (one sync): what ranks exchange to merge their gaps."""
        if self._sums is None:
            return 0.0, 0.0, 0.0
        total, tokens, largest = self._sums.tolist()
        return total, tokens, largest

    def metrics(self) -> dict[str, float]:
        """``rollout/logprob_gap`` (mean, nats/token) and ``rollout/logprob_gap_max``; empty if nothing was added."""
        return gap_metrics(*self.totals())


def gap_metrics(total: float, tokens: float, largest: float) -> dict[str, float]:
    """The metrics of summed (total, tokens) and the largest difference; empty without tokens."""
    if tokens == 0:
        return {}
    return {"rollout/logprob_gap": total / tokens, "rollout/logprob_gap_max": largest}


def logprob_gap_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """One-shot gap of a whole batch ([B, L] each)."""
    gap = LogprobGap()
    gap.add(trainer_logprobs, engine_logprobs, mask)
    return gap.metrics()
