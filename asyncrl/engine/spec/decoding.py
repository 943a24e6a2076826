"""SpeculativeDecoder: when to speculate, and one speculative step (propose -> verify -> commit).

Adaptive by batch size: a step may speculate only when no prompt waits for prefill and at most
``disable_by_batch_size`` sequences run (the long tail of an RL rollout, where a decode step
is bound by reading the weights and a verify pass of k+1 tokens per row costs about as much
as one token). Above it, decode is compute- and KV-bound and speculation would only add
work, so the plain (overlapped) decode step runs, with its speed unchanged.

Adaptive by measurement (``adaptive``, on by default): within those limits, ``AdaptiveGate``
(spec/adaptive.py) times whole speculative and plain decode steps and speculates only while its
tokens per second of wall time keep up with plain decode's at the current batch size (sampled
rollouts at temperature 1 were slower with every drafter on an H200), re-probing the losing mode
now and then. ``adaptive=False``: speculate whenever the limits allow (the old behaviour).

A speculative step is synchronous: drafting needs the sequences' latest tokens, so ``LLM``
first reads the decode step in flight. Per sequence, drafting stops once its acceptance rate
over at least ``acceptance_window`` drafts falls below ``min_acceptance`` (a drifted draft
costs verify work for nothing).

Metrics: ``acceptance_rate`` = accepted / drafted tokens, ``tokens_per_target_pass`` =
emitted tokens / rows verified (1 + accepted per row and step; 1.0 means no gain); with the
gate, ``spec_gate_*`` (``AdaptiveGate.metrics``): plain steps it chose where speculation was
allowed, probes, switches, and the latest tokens/s of both modes at the last batch bucket.
Where the time went: ``spec_seconds`` (wall of speculative steps), ``spec_catch_up_seconds`` /
``spec_catch_up_tokens`` (steps whose proposer first caught up on positions decoded plain, and
how many positions), ``spec_plain_seconds`` / ``spec_plain_timed_steps`` (plain steps the gate timed).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from asyncrl.engine.scheduler import ScheduledBatch, Scheduler
from asyncrl.engine.sequence import Sequence
from asyncrl.engine.spec.adaptive import AdaptiveGate
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
    def __init__(self, config: SpeculativeConfig, proposer, runner, gate: Optional[AdaptiveGate] = None):
        self.config = config
        self.gate = gate if gate is not None else (AdaptiveGate() if config.adaptive else None)
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        if hasattr(proposer, "attach"):
            proposer.attach(runner)
        self.verify_step = VerifyStep(runner, self.k, config.disable_by_batch_size)
        self.steps = 0
        self.catch_up_steps = 0  # speculative steps whose proposer first caught up (not timed by the gate)
        # wall seconds of speculative steps (catch-up steps apart) and of the plain steps the gate timed:
        # where a run's time went, so a gate that loses to plain decode shows whether probes, catch-ups
        # or the plain steps themselves cost it (bench/spec_trained_target.py reports them per row)
        self.seconds = 0.0
        self.catch_up_seconds = 0.0
        self.catch_up_tokens = 0
        self.plain_seconds = 0.0
        self.plain_timed_steps = 0
        self.rows = 0          # sequence-steps verified (target passes per sequence)
        self.drafted = 0
        self.accepted = 0

    def should_run(self, scheduler: Scheduler) -> bool:
        """Whether the next step speculates: the hard limits (no prompt waiting, 1 to
        ``disable_by_batch_size`` running), then the gate's choice (plain when it measured plain faster)."""
        n = len(scheduler.running)
        if scheduler.waiting or not 0 < n <= self.config.disable_by_batch_size:
            return False
        return self.gate is None or self.gate.choose(n)

    @property
    def clock(self):
        """The gate's clock (``time.perf_counter``; a fake one in tests), or None without a gate."""
        return self.gate.clock if self.gate is not None else None

    def record_plain(self, batch: ScheduledBatch, seconds: float) -> None:
        """A plain decode step of ``batch`` took ``seconds`` of wall time (one token per row): the
        gate's plain estimate (``LLM.step`` calls this only for steps it timed whole)."""
        if self.gate is not None and not batch.is_prefill:
            self.gate.record(False, len(batch.seqs), len(batch.seqs), seconds)
            self.plain_seconds += seconds
            self.plain_timed_steps += 1

    def _budgets(self, seqs: list[Sequence], budgets: list[int]) -> list[int]:
        """Drafts per row: the scheduler's budget, 0 for sequences whose drafts stopped paying."""
        c = self.config
        if c.min_acceptance <= 0:
            return budgets
        return [0 if s.spec_drafted >= c.acceptance_window and s.spec_accepted < c.min_acceptance * s.spec_drafted
                else b for s, b in zip(seqs, budgets)]

    def step(self, scheduler: Scheduler, version: int) -> list[Sequence]:
        """One speculative step over the running batch; returns the sequences it finished."""
        clock = self.gate.clock if self.gate is not None else time.perf_counter
        started = clock()
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
        finished = scheduler.postprocess_verify(batch, out.tokens, out.logprobs, version)
        # A step whose proposer first caught up on positions decoded without speculation (a draft
        # model's K/V prefill, the EAGLE head's entries: tens of ms after a long plain stretch on
        # the H200, when EAGLE still ran a target forward for the features) pays for the switch
        # into speculation, not for speculating: timed, it made every probe look several times
        # slower than plain decode and speculation never came back (draft model 0.78x off where it
        # runs 2.3x). The gate times the steps after.
        caught_up_tokens = int(getattr(self.proposer, "catch_up_tokens", 0))  # (numpy sums on EAGLE's side)
        seconds = clock() - started
        if caught_up_tokens > 0:
            self.catch_up_steps += 1
            self.catch_up_tokens += caught_up_tokens
            self.catch_up_seconds += seconds
            if self.gate is not None:  # the price of the switch into speculation, which probes pay
                self.gate.record_switch(len(batch.seqs), int(emitted.sum()), seconds)
        else:
            self.seconds += seconds
            if self.gate is not None:
                self.gate.record(True, len(batch.seqs), int(emitted.sum()), seconds)
        return finished

    @property
    def metrics(self) -> dict:
        return dict(spec_steps=self.steps, spec_catch_up_steps=self.catch_up_steps, spec_rows=self.rows, spec_draft_tokens=self.drafted,
                    spec_seconds=self.seconds, spec_catch_up_seconds=self.catch_up_seconds,
                    spec_catch_up_tokens=self.catch_up_tokens, spec_plain_seconds=self.plain_seconds,
                    spec_plain_timed_steps=self.plain_timed_steps,
                    spec_accepted_tokens=self.accepted,
                    spec_acceptance_rate=round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                    spec_tokens_per_target_pass=round((self.rows + self.accepted) / self.rows, 4) if self.rows else 0.0,
                    **(self.gate.metrics if self.gate is not None else {}))
