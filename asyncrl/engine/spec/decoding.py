"""SpeculativeDecoder: when to speculate, and one speculative step (propose -> verify -> commit).

Adaptive by batch size: a step speculates only when no prompt waits for prefill and at most
``disable_by_batch_size`` sequences run (the long tail of an RL rollout, where a decode step
is bound by reading the weights and a verify pass of k+1 tokens per row costs about as much
as one token). Above it, decode is compute- and KV-bound and speculation would only add
work, so the plain (overlapped) decode step runs, with its speed unchanged.

A speculative step is synchronous: drafting needs the sequences' latest tokens, so ``LLM``
first reads the decode step in flight. Per sequence, drafting stops once its acceptance rate
over at least ``acceptance_window`` drafts falls below ``min_acceptance`` (a drifted draft
costs verify work for nothing).

Metrics: ``acceptance_rate`` = accepted / drafted tokens, ``tokens_per_target_pass`` =
emitted tokens / rows verified (1 + accepted per row and step; 1.0 means no gain).
"""
from __future__ import annotations

import numpy as np

from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.sequence import Sequence
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.verify_step import Drafts, VerifyStep


def make_proposer(config: SpeculativeConfig, dtype, device, target_config):
    """The proposer of ``config.method``; built before the target's K/V pool is sized (a draft
    model's weights and K/V take their share of memory first: ``block_bytes``)."""
    if config.method == "ngram":
        from asyncrl.engine.spec.ngram import NgramProposer
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min,
                             config.group_lookup)
    if config.method == "eagle":
        from asyncrl.engine.spec.eagle import EagleProposer
        return EagleProposer(config, dtype, device, target_config)
    from asyncrl.engine.spec.draft_model import DraftModelProposer
    return DraftModelProposer(config, dtype, device, target_config)


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer, runner):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        if hasattr(proposer, "attach"):
            proposer.attach(runner)
        self.verify_step = VerifyStep(runner, self.k, config.disable_by_batch_size)
        self.steps = 0
        self.rows = 0          # sequence-steps verified (target passes per sequence)
        self.drafted = 0
        self.accepted = 0

    def should_run(self, scheduler: Scheduler) -> bool:
        n = len(scheduler.running)
        return not scheduler.waiting and 0 < n <= self.config.disable_by_batch_size

    def _budgets(self, seqs: list[Sequence], budgets: list[int]) -> list[int]:
        """Drafts per row: the scheduler's budget, 0 for sequences whose drafts stopped paying."""
        c = self.config
        if c.min_acceptance <= 0:
            return budgets
        return [0 if s.spec_drafted >= c.acceptance_window and s.spec_accepted < c.min_acceptance * s.spec_drafted
                else b for s, b in zip(seqs, budgets)]

    def step(self, scheduler: Scheduler, version: int) -> list[Sequence]:
        """One speculative step over the running batch; returns the sequences it finished."""
        batch = scheduler.schedule_verify(self.k)
        if batch is None:
            return []
        batch.draft_budgets = self._budgets(batch.seqs, batch.draft_budgets)
        ids, counts, probs = self.proposer.propose(batch, batch.draft_budgets)
        out = self.verify_step.run(batch, Drafts(ids, counts, probs))
        self.proposer.verified(batch, out)
        emitted = np.array([len(t) for t in out.tokens])
        accepted = emitted - 1
        for seq, d, a in zip(batch.seqs, counts, accepted):
            seq.spec_drafted += int(d)
            seq.spec_accepted += int(a)
        self.steps += 1
        self.rows += len(batch.seqs)
        self.drafted += int(counts.sum())
        self.accepted += int(accepted.sum())
        return scheduler.postprocess_verify(batch, out.tokens, out.logprobs, version)

    @property
    def metrics(self) -> dict:
        return dict(spec_steps=self.steps, spec_rows=self.rows, spec_draft_tokens=self.drafted,
                    spec_accepted_tokens=self.accepted,
                    spec_acceptance_rate=round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                    spec_tokens_per_target_pass=round((self.rows + self.accepted) / self.rows, 4) if self.rows else 0.0)
