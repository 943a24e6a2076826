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
``(seed, sample, position)``) and the verifier (``verifier.py``); one device->host copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, gathered_host_arrays, gathered_metadata
from asyncrl.engine.cuda_graphs import capture_graphs
from asyncrl.engine.sampler import row_keys
from asyncrl.engine.scheduler import ScheduledBatch
from asyncrl.engine.spec.verifier import verify


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
    which an EAGLE head drafts from) and the emitted counts on the device ``[B]``."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    hidden: torch.Tensor
    num_emitted: torch.Tensor


class VerifyStep:
    def __init__(self, runner, k: int, max_batch: int):
        self.runner, self.k, self.q = runner, k, k + 1
        # the kernel walks every row to ``start + Q``, which may pass max_model_len for the
        # padded drafts of a row near the end: extra scratch columns keep its table reads in range
        self.table_width = runner._bt_width() + -(-self.q // runner.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.vars: dict[str, torch.Tensor] = {}
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

    def _sampling_host(self, batch: ScheduledBatch, starts: np.ndarray) -> tuple[list[np.ndarray], bool]:
        """[floats ``[2, B]`` (temperature, top_p), ints ``[2, B]`` (top_k, unused 0), keys
        ``[B, Q]``] for the verifier, and whether any row filters by top-k / top-p."""
        seqs, Q = batch.seqs, self.q
        temp = np.array([s.params.temperature for s in seqs], dtype=np.float32)
        top_p = np.array([s.params.top_p for s in seqs], dtype=np.float32)
        top_k = np.array([s.params.top_k for s in seqs], dtype=np.int64)
        pos = starts[:, None] + 1 + np.arange(Q)[None, :]  # the position each row's token takes
        keys = row_keys(np.array([s.seed for s in seqs], dtype=np.int64)[:, None],
                        np.array([s.sample_index for s in seqs], dtype=np.int64)[:, None], pos)
        use_filter = bool((top_k > 0).any() or (top_p < 1.0).any())
        return [np.stack([temp, top_p]), np.stack([top_k, np.zeros_like(top_k)]), keys.astype(np.int64)], use_filter

    # ---- forward -------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, drafts: Drafts) -> VerifyOutput:
        r, B, Q = self.runner, len(batch.seqs), self.q
        bs = min((b for b in self.graphs if b >= B), default=None)
        rows = B if bs is None else bs
        (ids, pos), starts = self._host_inputs(batch, drafts, rows)
        sampling, use_filter = self._sampling_host(batch, starts)
        counts = np.asarray(drafts.counts, dtype=np.int64)
        if r.is_cuda:
            host = [ids, pos] + self._paged_host(batch, starts, rows)
            ids_d, pos_d, slots, bt, ctx, floats, ints, keys, counts_d = r.h2d.put(host + sampling + [counts])
            ids_d = self._device_drafts(ids_d, drafts, rows)
            meta = AttentionMetadata(slot_mapping=slots, block_tables=bt, context_lens=ctx, paged_decode=True,
                                     query_len=Q)
            hidden = self._forward_paged(ids_d, pos_d, meta, bs)[:B * Q]
        else:
            g = gathered_host_arrays([s.block_table for s in batch.seqs], list(starts), [Q] * B,
                                     r.block_size, r.scratch_block)
            ids_d, pos_d, *rest = r.h2d.put([ids, pos] + g.arrays() + sampling + [counts])
            ids_d = self._device_drafts(ids_d, drafts, rows)
            meta = gathered_metadata(*rest[:6], g.uniform)
            floats, ints, keys, counts_d = rest[6:]
            hidden = r.model(ids_d, pos_d, meta)
        logits = r.model.lm_head(hidden).view(B, Q, -1)
        sampled = self._sample_all(logits, floats, ints, keys, use_filter)
        draft_ids = ids_d.view(rows, Q)[:B, 1:]
        res = verify(logits, draft_ids, counts_d, floats[0], ints[0], floats[1], keys,
                     draft_probs=drafts.probs, use_filter=use_filter, sampled=sampled)
        host = torch.cat([res.tokens.reshape(-1).double(), res.logprobs.reshape(-1).double(),
                          res.num_emitted.double()]).cpu().tolist()
        n = B * Q
        toks, lps, emitted = host[:n], host[n:2 * n], host[2 * n:]
        out_t = [[int(t) for t in toks[i * Q: i * Q + int(e)]] for i, e in enumerate(emitted)]
        out_l = [lps[i * Q: i * Q + int(e)] for i, e in enumerate(emitted)]
        return VerifyOutput(out_t, out_l, hidden, res.num_emitted)

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

    def _forward_paged(self, ids, pos, meta: AttentionMetadata, bs: Optional[int]) -> torch.Tensor:
        if bs is None:
            return self.runner.model(ids, pos, meta)
        g, n = self.vars, bs * self.q
        g["input_ids"][:n].copy_(ids)
        g["positions"][:n].copy_(pos)
        g["slot_mapping"][:n].copy_(meta.slot_mapping)
        g["block_tables"][:bs].copy_(meta.block_tables)
        g["context_lens"][:bs].copy_(meta.context_lens)
        self.graphs[bs].replay()
        return g["hidden"][:n]

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        r, Q = self.runner, self.q
        max_bs, dev = max(sizes), r.device
        scratch = r.scratch_block * r.block_size
        self.vars = dict(
            input_ids=torch.zeros(max_bs * Q, dtype=torch.long, device=dev),
            positions=torch.arange(Q, device=dev).repeat(max_bs),
            slot_mapping=torch.full((max_bs * Q,), scratch, dtype=torch.long, device=dev),
            block_tables=torch.full((max_bs, self.table_width), r.scratch_block, dtype=torch.int32, device=dev),
            context_lens=torch.full((max_bs,), Q, dtype=torch.int32, device=dev),
            hidden=torch.zeros(max_bs * Q, r.model.config.hidden_size, dtype=r.dtype, device=dev),
        )
        self.graphs.update(capture_graphs(sizes, self._graph_forward)[0])

    def _graph_forward(self, bs: int) -> None:
        """The target pass of ``bs`` rows (``bs * Q`` tokens) on the graph buffers."""
        g, n = self.vars, bs * self.q
        meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:n], block_tables=g["block_tables"][:bs],
                                 context_lens=g["context_lens"][:bs], paged_decode=True, query_len=self.q)
        g["hidden"][:n] = self.runner.model(g["input_ids"][:n], g["positions"][:n], meta)
