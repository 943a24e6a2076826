"""VerifyStep: the target forward of a speculative step, beside the runner's decode step.

Each of the ``B`` rows computes ``Q = K + 1`` positions from ``start`` (its last token, then
its drafts, padded to K), so the step's ``B * Q`` tokens are packed row by row. K/V of every
position is written into the row's pages (the drafts' too: ``Scheduler.schedule_verify``
allocated blocks for ``1 + budget`` positions; positions past the budget write the scratch
block); rejected positions are overwritten when the sequence reaches them again, and no
cache bookkeeping ever counts them (``postprocess_verify``).

GPU: the paged decode kernel with ``query_len = Q`` (causal among the row's own tokens), in
a CUDA graph per batch bucket up to ``disable_by_batch_size``, captured beside the decode
graphs. CPU (and eager GPU): the gathered path, as a chunked prefill of Q tokens.
Then the LM head on all ``B * Q`` rows, the engine's sampler on every position (keys of
``(seed, sample, position)``) and the verifier (``verifier.py``); one device->host copy of a
``[B, 2Q + 1]`` result.

A bucket's graph holds the whole round when it can: its inputs (ids, positions, slots, block
tables, context lengths, and the sampling arrays and draft counts) are staged by ONE
host->device copy (``staging.StaticInputs``), and the graph runs the target pass, the LM head,
the sampler's one-pass kernel and the one-hot verifier, writing the packed result the host
reads back. So a round costs the host one copy, one graph launch and one read-back instead of
~40 eager launches (issue 23: the verify phase's host work was ~1.5 ms at batch 8 on an H200,
the device's ~0.9 ms). Rows with top-k / top-p (the compiled torch sampler, not capturable)
and probabilistic drafts (``draft probs [B, K, V]``) run the same sampler and verifier eagerly
on the graph's logits; the results are the same functions of the same inputs either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, gathered_host_arrays, gathered_metadata
from asyncrl.engine.cuda_graphs import capture_graphs
from asyncrl.engine.sampler import position_keys, sequence_keys
from asyncrl.engine.scheduler import ScheduledBatch
from asyncrl.engine.spec.verifier import verify
from asyncrl.engine.staging import StaticInputs

# ASYNCRL_VERIFY_GRAPH_TAIL=0: the LM head stays in the verify graph but the sampler and the
# verifier run eagerly after it (for A/B runs, or if a capture fails)
TAIL_IN_GRAPH = os.environ.get("ASYNCRL_VERIFY_GRAPH_TAIL", "1") != "0"


@dataclass
class Drafts:
    """ids ``[B, K]`` int64 (host numpy or device tensor), counts ``[B]`` int64 (host), and
    probs ``[B, K, V]`` fp32 on the device (probabilistic drafts) or None (one-hot)."""
    ids: object
    counts: np.ndarray
    probs: Optional[torch.Tensor] = None


@dataclass
class VerifyOutput:
    """Host lists per row: emitted tokens and their target log-probs (1..count+1 each);
    ``hidden [B * Q, H]`` on the device (the target's last hidden state of every position,
    which an EAGLE head drafts from) and the emitted counts on the device ``[B]`` (on the graph
    path both are views of the graph's buffers: valid until the next verify pass)."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    hidden: torch.Tensor
    num_emitted: torch.Tensor


class VerifyStep:
    """The target pass + sampler + verifier of a speculative step. Invariant: whichever path runs
    (graph with its tail, graph + eager tail, eager paged, CPU gathered), the emitted tokens and
    log-probs are the same functions of (logits, drafts, counts, sampling params, keys); the graph
    buffers (``vars``, ``staged``) are only read back before the next pass overwrites them."""

    def __init__(self, runner, k: int, max_batch: int):
        self.runner, self.k, self.q = runner, k, k + 1
        # the kernel walks every row to ``start + Q``, which may pass max_model_len for the
        # padded drafts of a row near the end: extra scratch columns keep its table reads in range
        self.table_width = runner._bt_width() + -(-self.q // runner.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.vars: dict[str, torch.Tensor] = {}
        # the sampler + verifier inside the bucket's graph need the sampler's one-pass kernel (the
        # torch.compile'd path cannot be captured); top-k / top-p and probabilistic drafts run eagerly
        self.tail_sampler = getattr(runner.sampler, "fast", None)
        self.tail_in_graph = self.tail_sampler is not None and TAIL_IN_GRAPH
        self._seq_keys: dict[tuple[int, int], int] = {}
        self.rounds = {"graph_tail": 0, "graph": 0, "eager": 0}  # how each verify pass ran
        if runner.is_cuda and not runner.config.enforce_eager:
            self._capture([b for b in runner._graph_sizes() if b <= max_batch] or [1])

    # ---- inputs ------------------------------------------------------------------
    def _host_inputs(self, batch: ScheduledBatch, drafts: Drafts, rows: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(ids, positions) ``[rows * Q]`` int64 and the row starts ``[B]``; padding rows
        (past ``B``) take position 0..Q-1 and token 0."""
        B, Q = len(batch.seqs), self.q
        starts = np.asarray(batch.starts, dtype=np.int64)
        ids = np.zeros((rows, Q), dtype=np.int64)
        ids[:B, 0] = [s.token_ids[-1] for s in batch.seqs]
        if isinstance(drafts.ids, np.ndarray):
            ids[:B, 1:] = drafts.ids
        pos = np.tile(np.arange(Q, dtype=np.int64), (rows, 1))
        pos[:B] += starts[:, None]
        return [ids.reshape(-1), pos.reshape(-1)], starts

    def _paged_host(self, batch: ScheduledBatch, starts: np.ndarray, rows: int) -> list[np.ndarray]:
        """slot_mapping ``[rows * Q]`` int64, block tables ``[rows, W]`` int32, context lengths
        ``[rows]`` int32 for the paged kernel; positions past a row's draft budget write the
        scratch block."""
        r, B, Q, bsz = self.runner, len(batch.seqs), self.q, self.runner.block_size
        scratch = r.scratch_block * bsz
        bt = np.full((rows, self.table_width), r.scratch_block, dtype=np.int32)
        if batch.block_tables is not None:  # the block manager's mirrored rows: no per-row Python
            bt[:B, :batch.block_tables.shape[1]] = batch.block_tables
        else:
            for i, s in enumerate(batch.seqs):
                bt[i, :len(s.block_table)] = s.block_table
        pos = starts[:, None] + np.arange(Q)[None, :]
        ok = np.arange(Q)[None, :] <= np.asarray(batch.draft_budgets)[:, None]
        blk = bt[np.arange(B)[:, None], np.minimum(pos // bsz, bt.shape[1] - 1)].astype(np.int64)
        slots = np.full((rows, Q), scratch, dtype=np.int64)
        slots[:B] = np.where(ok, blk * bsz + pos % bsz, scratch)
        ctx = np.full(rows, Q, dtype=np.int32)
        ctx[:B] = starts + Q
        return [slots.reshape(-1), bt, ctx]

    def _sampling_rows(self, batch: ScheduledBatch, starts: np.ndarray, rows: int) -> tuple[dict, bool]:
        """``temp, top_p [rows]`` fp32, ``top_k [rows]`` int64, ``keys [rows, Q]`` int64 (row j: the
        key of position ``start + j + 1``) and ``counts [rows]`` int64 are filled by ``run``; padding
        rows: greedy, no filter, key 0, no drafts. Also whether any real row filters (top-k / top-p)."""
        seqs, B, Q = batch.seqs, len(batch.seqs), self.q
        h = dict(temp=np.zeros(rows, dtype=np.float32), top_p=np.ones(rows, dtype=np.float32),
                 top_k=np.zeros(rows, dtype=np.int64), keys=np.zeros((rows, Q), dtype=np.int64))
        h["temp"][:B] = [s.params.temperature for s in seqs]
        h["top_p"][:B] = [s.params.top_p for s in seqs]
        h["top_k"][:B] = [s.params.top_k for s in seqs]
        pos = starts[:, None] + 1 + np.arange(Q)[None, :]  # the position each row's token takes
        h["keys"][:B] = position_keys(self._sequence_keys(seqs)[:, None], pos)
        use_filter = bool((h["top_k"][:B] > 0).any() or (h["top_p"][:B] < 1.0).any())
        return h, use_filter

    def _sequence_keys(self, seqs) -> np.ndarray:
        """``sampler.sequence_keys`` of each row ``[B]`` int64, kept per (seed, sample index): the
        three hash rounds of a row's key that do not depend on the position are computed once."""
        ids = [(s.seed, s.sample_index) for s in seqs]
        missing = [i for i in ids if i not in self._seq_keys]
        if missing:
            if len(self._seq_keys) > 65536:  # sequences come and go over a run: bound the memory
                self._seq_keys.clear()
            m = np.array(missing, dtype=np.int64)
            self._seq_keys.update(zip(missing, sequence_keys(m[:, 0], m[:, 1]).tolist()))
        return np.array([self._seq_keys[i] for i in ids], dtype=np.int64)

    @staticmethod
    def _sampler_arrays(h: dict, B: int) -> list[np.ndarray]:
        """The eager tail's inputs from ``_sampling_rows``: floats ``[2, B]`` (temperature, top_p),
        ints ``[2, B]`` (top_k, unused 0), keys ``[B, Q]``."""
        top_k = h["top_k"][:B]
        return [np.stack([h["temp"][:B], h["top_p"][:B]]), np.stack([top_k, np.zeros_like(top_k)]), h["keys"][:B]]

    # ---- forward -------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, drafts: Drafts) -> VerifyOutput:
        r, B, Q = self.runner, len(batch.seqs), self.q
        bs = min((b for b in self.graphs if b >= B), default=None)
        rows = B if bs is None else bs
        (ids, pos), starts = self._host_inputs(batch, drafts, rows)
        sampling, use_filter = self._sampling_rows(batch, starts, rows)
        counts = np.zeros(rows, dtype=np.int64)
        counts[:B] = drafts.counts
        if bs is not None:
            return self._run_graph(batch, drafts, bs, [ids, pos] + self._paged_host(batch, starts, rows),
                                   dict(sampling, counts=counts), use_filter)
        self.rounds["eager"] += 1
        sampling = self._sampler_arrays(sampling, B)
        if r.is_cuda:  # eager paged (no graphs, or a batch above the largest bucket)
            host = [ids, pos] + self._paged_host(batch, starts, rows)
            ids_d, pos_d, slots, bt, ctx, floats, ints, keys, counts_d = r.h2d.put(host + sampling + [counts])
            ids_d = self._device_drafts(ids_d, drafts, rows)
            meta = AttentionMetadata(slot_mapping=slots, block_tables=bt, context_lens=ctx, paged_decode=True,
                                     query_len=Q)
            hidden = r.model(ids_d, pos_d, meta)
        else:
            g = gathered_host_arrays([s.block_table for s in batch.seqs], list(starts), [Q] * B,
                                     r.block_size, r.scratch_block)
            ids_d, pos_d, *rest = r.h2d.put([ids, pos] + g.arrays() + sampling + [counts])
            ids_d = self._device_drafts(ids_d, drafts, rows)
            n = len(g.arrays())
            meta = gathered_metadata(*rest[:n], g.shape)
            floats, ints, keys, counts_d = rest[n:]
            hidden = r.model(ids_d, pos_d, meta)
        logits = r.model.lm_head(hidden).view(B, Q, -1)
        res = self._tail(logits, ids_d.view(rows, Q)[:B, 1:], counts_d, floats, ints, keys, drafts.probs, use_filter)
        return self._read_back(res, hidden, B)

    def _tail(self, logits, draft_ids, counts_d, floats, ints, keys, probs, use_filter):
        """The engine's sampler on every position, then the verifier: ``VerifyResult`` of ``[B]`` rows."""
        sampled = self._sample_all(logits, floats, ints, keys, use_filter)
        return verify(logits, draft_ids, counts_d, floats[0], ints[0], floats[1], keys,
                      draft_probs=probs, use_filter=use_filter, sampled=sampled)

    @staticmethod
    def _pack(res) -> torch.Tensor:
        """``[B, 2Q + 1]`` fp64: tokens, log-probs, emitted count (token ids < 2^53 are exact)."""
        return torch.cat([res.tokens.double(), res.logprobs.double(), res.num_emitted.double()[:, None]], 1)

    def _read_back(self, res, hidden: torch.Tensor, B: int) -> VerifyOutput:
        return self._unpack(self._pack(res).cpu().numpy(), hidden[:B * self.q], res.num_emitted)

    def _unpack(self, packed: np.ndarray, hidden: torch.Tensor, num_emitted: torch.Tensor) -> VerifyOutput:
        """Host lists per row from the read-back ``[B, 2Q + 1]`` (one device->host copy)."""
        Q = self.q
        emitted = packed[:, 2 * Q].astype(np.int64).tolist()
        toks, lps = packed[:, :Q].astype(np.int64), packed[:, Q:2 * Q]
        out_t = [toks[i, :e].tolist() for i, e in enumerate(emitted)]
        out_l = [lps[i, :e].tolist() for i, e in enumerate(emitted)]
        return VerifyOutput(out_t, out_l, hidden, num_emitted)

    def _run_graph(self, batch, drafts: Drafts, bs: int, paged: list[np.ndarray], sampling: dict,
                   use_filter: bool) -> VerifyOutput:
        """The bucket's graph: every input staged in ONE host->device copy; with the tail in the
        graph (one-hot drafts, no top-k / top-p) the round reads back one ``[B, 2Q + 1]`` tensor;
        otherwise the sampler and verifier run eagerly on the graph's logits."""
        B, Q, g = len(batch.seqs), self.q, self.vars
        names = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens")
        self.staged.put(bs, dict(zip(names, paged), **sampling))
        v = self.views[bs]
        if not isinstance(drafts.ids, np.ndarray):  # a draft model's device drafts, after the copy
            v["input_ids"].view(bs, Q)[:drafts.ids.shape[0], 1:].copy_(drafts.ids)
        self.graphs[bs].replay()
        hidden = g["hidden"][:B * Q]
        if self.tail_in_graph and not use_filter and drafts.probs is None:
            self.rounds["graph_tail"] += 1
            return self._unpack(g["packed"][:B].cpu().numpy(), hidden, g["emitted"][:B])
        self.rounds["graph"] += 1
        logits = g["logits"][:bs * Q].view(bs, Q, -1)[:B]
        floats = torch.stack([v["temp"][:B], v["top_p"][:B]])
        ints = torch.stack([v["top_k"][:B], torch.zeros_like(v["top_k"][:B])])
        res = self._tail(logits, v["input_ids"].view(bs, Q)[:B, 1:], v["counts"][:B], floats, ints,
                         v["keys"][:B], drafts.probs, use_filter)
        return self._read_back(res, hidden, B)

    def _device_drafts(self, ids: torch.Tensor, drafts: Drafts, rows: int) -> torch.Tensor:
        """Input ids with device-side drafts (a draft model's) written into positions 1..K."""
        if isinstance(drafts.ids, np.ndarray):
            return ids
        ids = ids.view(rows, self.q).clone()
        ids[:drafts.ids.shape[0], 1:] = drafts.ids
        return ids.view(-1)

    def _sample_all(self, logits, floats, ints, keys, use_filter):
        """The engine's sampler on every position: tokens, log-probs ``[B * Q]``."""
        Q = self.q
        f = floats.repeat_interleave(Q, dim=1)
        i = torch.stack([keys.reshape(-1), ints[0].repeat_interleave(Q)])
        return self.runner.sampler(logits.reshape(-1, logits.shape[-1]), f, i, use_filter)

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        """Per bucket: the staged inputs (``StaticInputs``: one copy per round), the target pass,
        its LM head into ``logits``, and (with the one-pass sampler) the tail into ``packed``."""
        r, Q, max_bs = self.runner, self.q, max(sizes)
        V, H = r.model.config.vocab_size, r.model.config.hidden_size
        self.staged = StaticInputs.padded({bs: self._padding_inputs(bs) for bs in sizes}, r.device)
        self.views = {bs: self.staged.views(bs) for bs in sizes}  # built once: ~30 view ops a round otherwise
        self.vars = dict(hidden=torch.zeros(max_bs * Q, H, dtype=r.dtype, device=r.device),
                         logits=torch.zeros(max_bs * Q, V, dtype=r.dtype, device=r.device),
                         packed=torch.zeros(max_bs, 2 * Q + 1, dtype=torch.float64, device=r.device),
                         emitted=torch.zeros(max_bs, dtype=torch.int64, device=r.device))
        self.graphs.update(capture_graphs(sizes, self._graph_forward, before_warmup=self.staged.put_padding)[0])

    def _padding_inputs(self, bs: int) -> dict[str, np.ndarray]:
        """Bucket ``bs``'s staged inputs with every row padding (positions 0..Q-1 on the scratch
        block, greedy, no drafts): the layout of ``StaticInputs`` and the warm-up's inputs."""
        r, Q = self.runner, self.q
        return dict(input_ids=np.zeros(bs * Q, dtype=np.int64), positions=np.tile(np.arange(Q, dtype=np.int64), bs),
                    slot_mapping=np.full(bs * Q, r.scratch_block * r.block_size, dtype=np.int64),
                    block_tables=np.full((bs, self.table_width), r.scratch_block, dtype=np.int32),
                    context_lens=np.full(bs, Q, dtype=np.int32), temp=np.zeros(bs, dtype=np.float32),
                    top_p=np.ones(bs, dtype=np.float32), top_k=np.zeros(bs, dtype=np.int64),
                    keys=np.zeros((bs, Q), dtype=np.int64), counts=np.zeros(bs, dtype=np.int64))

    def _graph_forward(self, bs: int) -> None:
        """The target pass of ``bs`` rows (``bs * Q`` tokens) on the staged inputs, its logits and,
        when the sampler has its one-pass (unfiltered) kernel, the one-hot verifier's packed result."""
        r, Q, g, n = self.runner, self.q, self.vars, bs * self.q
        v = self.views[bs]
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"], block_tables=v["block_tables"],
                                 context_lens=v["context_lens"], paged_decode=True, query_len=Q)
        hidden = r.model(v["input_ids"], v["positions"], meta)
        g["hidden"][:n] = hidden
        logits = r.model.lm_head(hidden)
        g["logits"][:n] = logits
        if not self.tail_in_graph:
            return
        tokens, logprobs = self.tail_sampler(logits, v["temp"].repeat_interleave(Q), v["keys"].view(-1))
        res = verify(logits.view(bs, Q, -1), v["input_ids"].view(bs, Q)[:, 1:], v["counts"], v["temp"], v["top_k"],
                     v["top_p"], v["keys"], use_filter=False, sampled=(tokens, logprobs))
        g["packed"][:bs] = self._pack(res)
        g["emitted"][:bs] = res.num_emitted
