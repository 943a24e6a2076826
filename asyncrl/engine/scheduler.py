"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

A step is either a prefill step (waiting sequences, packed under the token budget; the
last one may be a chunk) or a decode step (one token for each running sequence).
Prefill goes first so new sequences join the running batch as soon as others finish.

When a decode step finds no free block, the most recently admitted running sequence is
preempted: its blocks are freed and it returns to the head of ``waiting`` to be
recomputed (its prefix blocks are usually still in the prefix cache). A sequence that
alone exceeds the pool is rejected by ``add`` so this can neither crash nor spin.

Invariant: every sequence is in exactly one of ``waiting`` / ``running`` until it
finishes; sequences in ``running`` have all their tokens but the last in the cache.

Overlapped scheduling (``LLM`` with ``async_scheduling``): the engine schedules step t+1
before it has read step t's sampled tokens. A running sequence then carries one *pending*
token (``Sequence.num_pending``) whose position is known and whose id stays on the device;
the decode step reads it there. ``postprocess`` (one step late) appends it and applies the
finish rules; a sequence that finished on a stop token may have had one more row computed
in the step already launched, which ``postprocess`` discards. A sequence whose pending
token reaches ``max_tokens`` / ``max_model_len`` is not scheduled again (no waste). A
waiting sequence is prefilled only once it has no pending token (all its ids on the host).
``num_cached_tokens`` advances when a step is scheduled, not when it completes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from asyncrl.engine.block_manager import BlockManager
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one model step computes.

    ``seqs[i]`` computes ``seqs[i].num_scheduled_tokens`` tokens from
    ``num_cached_tokens``. ``logit_seqs`` are the seqs whose last computed token yields
    logits (prefill completed, or decode). ``sample_seqs[j]`` draws its next token from
    logits row ``sample_rows[j]`` (a forked child reads its parent's row).
    ``copies``: (src, dst, num_tokens) KV blocks to copy after the forward (fork of a partial block).
    ``forks``: (parent, child) pairs forked this step (hybrid models copy the parent's recurrent
    state to the child after the forward; ``state_pool.py``).
    ``starts[i]``: first position ``seqs[i]`` computes (its ``num_cached_tokens`` when
    scheduled); the step's tokens of ``seqs[i]`` are positions ``[starts[i], starts[i] + n)``.
    ``input_src[i]`` (decode only): row of the previous step's sampled tokens that holds
    ``seqs[i]``'s input token (it is pending), or -1 (the id is on the host).
    ``key_positions[j]``: the position ``sample_seqs[j]``'s new token takes (keys its noise).
    Decode (and verify steps' ``block_tables``), gathered in the scheduler's loop so the runner needs none:
    ``block_tables`` ``[n, W]`` int32 (``BlockManager.tables`` rows; None without them) and
    ``last_ids[i]``, the input token id when it is on the host (else 0: pending).
    Verify steps (speculative decoding, ``schedule_verify``): every row computes ``1 + k``
    positions from ``starts[i]`` (its last token, then drafts); ``draft_budgets[i]`` <= k.
    """

    seqs: list[Sequence]
    is_prefill: bool
    logit_seqs: list[Sequence] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    input_src: list[int] = field(default_factory=list)
    key_positions: list[int] = field(default_factory=list)
    block_tables: Optional[np.ndarray] = None
    last_ids: list[int] = field(default_factory=list)
    draft_budgets: Optional[list[int]] = None  # verify steps (spec/): drafts each row may take


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: list[int], stop_checker: Optional[Callable[[Sequence], bool]] = None):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.eos = set(eos_token_ids)
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.prefill_tokens = 0  # tokens actually run through prefill (metrics)
        # called with a finishing sequence before its blocks are freed (routing capture, R3)
        self.on_finish: Optional[Callable[[Sequence], None]] = None

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        total = min(len(seq) + seq.params.max_tokens, self.max_model_len)
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt of {len(seq)} tokens >= max_model_len {self.max_model_len}")
        if seq.num_blocks_needed(self.bm.block_size, total) > len(self.bm.blocks):
            raise ValueError(f"a sequence of {total} tokens cannot fit the KV pool of "
                             f"{len(self.bm.blocks)} x {self.bm.block_size} tokens")
        self.waiting.append(seq)

    # ---- schedule ------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """The next step (prefill first), or None. Each sampling row leaves one pending token until
        ``postprocess``; a decode step marks its rows in its own loop."""
        batch = self._schedule_prefill()
        if batch is None:
            return self._schedule_decode()
        for j, seq in enumerate(batch.sample_seqs):
            batch.key_positions.append(seq.num_tokens)
            seq.num_pending += 1
            seq.pending_row = j
        return batch

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        if not self.waiting:  # the decode steps' case: no batch object built to be dropped
            return None
        batch = ScheduledBatch(seqs=[], is_prefill=True)
        budget = self.config.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + len(batch.seqs) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token in flight: prefill it once the id is here
                break
            if not seq.block_table:
                if not self.bm.can_allocate(seq):
                    break
                self.bm.allocate(seq)
            remaining = len(seq) - seq.num_cached_tokens
            n = min(remaining, budget)
            seq.num_scheduled_tokens = n
            budget -= n
            batch.seqs.append(seq)
            batch.starts.append(seq.num_cached_tokens)
            seq.num_cached_tokens += n
            self.prefill_tokens += n
            if n < remaining:
                break  # chunked: continues next step, stays at the head of waiting
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            row = len(batch.logit_seqs)
            batch.logit_seqs.append(seq)
            batch.sample_seqs.append(seq)
            batch.sample_rows.append(row)
            if seq.num_forks:
                self._fork(seq, row, batch)
        return batch if batch.seqs else None

    def _fork(self, parent: Sequence, row: int, batch: ScheduledBatch) -> None:
        """Create parent's siblings now. Those that fit share its prompt blocks and draw
        their first token from its logits row; the rest wait (and hit the prefix cache)."""
        n, parent.num_forks = parent.num_forks, 0
        base = parent.sample_index
        for i in range(1, n + 1):
            child = parent.fork(base + i, parent.seed)
            parent.group.append(child)
            child.group = parent.group
            fits = (self.config.enable_fork and len(self.running) < self.config.max_num_seqs
                    and self.bm.fork_cost(parent) <= self.bm.num_free_blocks)
            if not fits:
                self.waiting.append(child)
                continue
            copy = self.bm.fork(parent, child)
            if copy:
                batch.copies.append(copy)
            batch.forks.append((parent, child))
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            batch.sample_seqs.append(child)
            batch.sample_rows.append(row)

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        """One token for each running sequence, in order, up to ``max_num_seqs``. The hot
        loop of the engine (once per step per sequence): a sequence whose next position
        falls in a block it holds costs no BlockManager call."""
        scheduled: list[Sequence] = []
        kept: list[Sequence] = []  # running, in order (scheduled or finishing on a pending token)
        starts: list[int] = []
        src: list[int] = []
        rows: list[int] = []
        last: list[int] = []
        keys: list[int] = []  # key_positions: the position each row's new token takes
        bsz, max_len, max_seqs, running = self.bm.block_size, self.max_model_len, self.config.max_num_seqs, self.running
        while running and len(scheduled) < max_seqs:
            seq = running.popleft()
            pending = seq.num_pending
            start = len(seq.token_ids) + pending - 1  # the position this step computes
            if pending and (start + 1 - seq.num_prompt_tokens >= seq.params.max_tokens or start + 1 >= max_len):
                kept.append(seq)  # its pending token is its last: it finishes when that arrives
                continue
            if start >= len(seq.block_table) * bsz and not self._grow(seq):
                continue  # preempted itself: nothing else to take a block from
            seq.num_scheduled_tokens = 1
            seq.num_cached_tokens = start + 1
            starts.append(start)
            src.append(seq.pending_row if pending else -1)
            last.append(0 if pending else seq.token_ids[-1])
            rows.append(seq.table_row)
            keys.append(start + 1)
            seq.num_pending, seq.pending_row = pending + 1, len(scheduled)  # sampled by this step: pending
            scheduled.append(seq)
            kept.append(seq)
        running.extendleft(reversed(kept))
        if not scheduled:
            return None
        return ScheduledBatch(seqs=scheduled, is_prefill=False, logit_seqs=scheduled,
                              sample_seqs=scheduled, sample_rows=list(range(len(scheduled))), starts=starts,
                              input_src=src, last_ids=last, key_positions=keys,
                              block_tables=None if self.bm.tables is None else self.bm.tables[rows])

    def _grow(self, seq: Sequence) -> bool:
        """A new block for ``seq``'s next position, preempting the most recently admitted
        running sequences while none is free; False if ``seq`` itself had to go."""
        while not self.bm.can_append(seq):
            if self.running:
                self.preempt(self.running.pop())
            else:
                self.preempt(seq)
                return False
        self.bm.may_append(seq)
        return True

    # ---- speculative decoding (spec/): one verify step = last token + up to k drafts per row
    def schedule_verify(self, k: int) -> Optional[ScheduledBatch]:
        """A decode-shaped step where each running sequence computes its last token and up to
        ``k`` draft positions: ``num_scheduled_tokens = 1 + k`` for every row (the runner pads
        rows with fewer drafts), ``budgets[i]`` (``batch.draft_budgets``) = the drafts row i may
        take: fewer near ``max_tokens`` / ``max_model_len`` (every emitted token must fit) or
        when the pool has no block for them. Blocks are allocated for ``1 + budget`` positions
        (drafts write their K/V into the sequence's pages; rejected ones are overwritten later).
        Needs every sequence's tokens on the host (no pending token: ``LLM`` drains first)."""
        scheduled: list[Sequence] = []
        budgets: list[int] = []
        running, bsz = self.running, self.bm.block_size
        kept: list[Sequence] = []
        while running and len(scheduled) < self.config.max_num_seqs:
            seq = running.popleft()
            assert not seq.num_pending, "speculative steps need every token on the host"
            n = len(seq.token_ids)
            budget = max(0, min(k, seq.params.max_tokens - seq.num_completion_tokens - 1, self.max_model_len - n - 1))
            if budget and not self.bm.can_append(seq, 1 + budget):
                budget = 0  # no room for drafts: this row decodes one token
            if budget:
                self.bm.may_append(seq, 1 + budget)
            elif (n - 1) >= len(seq.block_table) * bsz and not self._grow(seq):
                continue
            seq.num_scheduled_tokens = 1 + k
            seq.num_cached_tokens = n  # provisional: postprocess_verify sets the accepted count
            scheduled.append(seq)
            kept.append(seq)
            budgets.append(budget)
        running.extendleft(reversed(kept))
        if not scheduled:
            return None
        return ScheduledBatch(seqs=scheduled, is_prefill=False, logit_seqs=scheduled, sample_seqs=scheduled,
                              sample_rows=list(range(len(scheduled))),
                              starts=[len(s.token_ids) - 1 for s in scheduled], draft_budgets=budgets,
                              block_tables=None if self.bm.tables is None
                              else self.bm.tables[[s.table_row for s in scheduled]])

    def postprocess_verify(self, batch: ScheduledBatch, tokens: list[list[int]], logprobs: list[list[float]],
                           version: int) -> list[Sequence]:
        """Commit a verify step: row i's emitted tokens (accepted drafts, then the corrected or
        bonus token) one at a time under the finish rules (a stop token ends the row; the
        rest is dropped). K/V is valid up to the last emitted token, which is not cached
        (the decode invariant): ``num_cached_tokens = len(token_ids) - 1``."""
        finished = []
        for seq, toks, lps in zip(batch.seqs, tokens, logprobs):
            if seq.status is SequenceStatus.FINISHED:
                continue
            for tok, lp in zip(toks, lps):
                if self._commit_token(seq, tok, lp, version):
                    finished.append(seq)
                    break
            else:
                seq.num_cached_tokens = len(seq.token_ids) - 1
        self._hash_filled_blocks(batch.seqs)
        return finished

    def drop_kv(self) -> int:
        """Free the K/V of every live sequence (after a weight update): running ones are
        preempted by recompute (back to the head of ``waiting``, in order), waiting ones lose
        any partial prefill. Tokens, log-probs and versions stay; the next prefill recomputes
        the K/V of prompt + completion so far. Returns the number of sequences reset."""
        running, self.running = list(self.running), deque()
        for seq in reversed(running):
            self.preempt(seq)
        partial = [s for s in list(self.waiting)[len(running):] if s.block_table]
        for seq in partial:
            self.bm.deallocate(seq)
        return len(running) + len(partial)

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)

    def _commit_token(self, seq: Sequence, tok: int, lp: float, version: int) -> bool:
        """Append one sampled token with its log-prob and version; True when it finished ``seq``."""
        seq.token_ids.append(tok)
        seq.logprobs.append(lp)
        seq.versions.append(version)
        reason = self._finish_reason(seq, tok)
        if reason:
            self._finish(seq, reason)
        return bool(reason)

    def _hash_filled_blocks(self, seqs) -> None:
        """Prefix caching: hash the blocks of live ``seqs`` that the step filled (only when a
        block may have filled up)."""
        if not self.bm.enable_prefix_caching:
            return
        bsz = self.bm.block_size
        for seq in seqs:
            if (seq.block_table and seq.status is not SequenceStatus.FINISHED
                    and min(seq.num_cached_tokens, len(seq.token_ids)) // bsz > seq.num_hashed_blocks):
                self.bm.hash_full_blocks(seq)

    # ---- postprocess ---------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, tokens: list[int], logprobs: list[float],
                    version: int) -> list[Sequence]:
        """Commit a completed step: its sampled tokens (pending until now), finishes, and
        prefix-cache hashes. Rows of sequences that finished meanwhile (a stop token read
        one step late, an abort) are discarded."""
        finished = []
        done = SequenceStatus.FINISHED
        # a decode step's rows are its sampling rows: their filled blocks are hashed in this loop
        # (``_hash_filled_blocks``' test, in batch order); a prefill step's chunks after it
        hashing, bsz = self.bm.enable_prefix_caching and not batch.is_prefill, self.bm.block_size
        for seq, tok, lp in zip(batch.sample_seqs, tokens, logprobs):
            seq.num_pending -= 1
            if seq.status is done:
                continue
            if self._commit_token(seq, tok, lp, version):
                finished.append(seq)
            elif (hashing and seq.block_table
                  and min(seq.num_cached_tokens, len(seq.token_ids)) // bsz > seq.num_hashed_blocks):
                self.bm.hash_full_blocks(seq)
        if batch.is_prefill:
            self._hash_filled_blocks(batch.seqs)
        return finished

    def _finish_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.stop_checker is not None and self.stop_checker(seq):
            return "stop"
        n = len(seq.token_ids)
        if n - seq.num_prompt_tokens >= p.max_tokens or n >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if self.on_finish is not None:
            self.on_finish(seq)
        self.bm.deallocate(seq)
        try:
            self.running.remove(seq)
        except ValueError:
            self.waiting.remove(seq)

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Finish every live sequence of these requests with reason "abort"."""
        victims = [s for s in list(self.waiting) + list(self.running) if s.request_id in request_ids]
        for seq in victims:
            seq.num_forks = 0
            self._finish(seq, "abort")
        return victims
