"""The engine-vs-trainer log-prob gap: how far the rollout engine's sampling log-probs are
from the trainer's log-probs of the same tokens under the same weights.

A gap near zero says the engine runs the trainer's weights and numerics (same dtype: < 1e-3
nats/token in fp32); a growing gap is the classic silent failure of RL stacks (stale weights,
a kernel or dtype mismatch, a tokenizer mismatch). The trainer measures it every step: from the
recomputed old log-probs when it has them, else from the update's own first forward, which
runs before the optimizer step and therefore on the weights that generated the batch.
"""
from __future__ import annotations

import torch


class LogprobGap:
    """Accumulates |trainer − engine| log-prob differences over response tokens.

    Invariant: ``total / tokens`` is the mean over every response token added since the last
    ``reset`` (token-weighted across micro-batches), and ``max`` the largest single difference.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.tokens, self.max = 0.0, 0.0, 0.0

    @torch.no_grad()
    def add(self, trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """All [B, L]; ``mask`` is 1 on response tokens (padding contributes nothing)."""
        keep = mask.bool()
        if not keep.any():
            return
        diff = (trainer_logprobs.detach().float() - engine_logprobs.to(trainer_logprobs.device).float()).abs()[keep]
        self.total += float(diff.sum())
        self.tokens += float(diff.numel())
        self.max = max(self.max, float(diff.max()))

    def metrics(self) -> dict[str, float]:
        """``rollout/logprob_gap`` (mean, nats/token) and ``rollout/logprob_gap_max``; empty if nothing was added."""
        if self.tokens == 0:
            return {}
        return {"rollout/logprob_gap": self.total / self.tokens, "rollout/logprob_gap_max": self.max}


def logprob_gap_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """One-shot gap of a whole batch ([B, L] each)."""
    gap = LogprobGap()
    gap.add(trainer_logprobs, engine_logprobs, mask)
    return gap.metrics()
