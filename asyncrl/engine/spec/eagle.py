"""EAGLE proposer: the draft head (``eagle_head.py``) drafts k tokens from the target's features.

Head entry p = (token p, target feature p - 1) lives in the head's own one-layer K/V pool with
the target's block geometry (the draft-model layout: same block tables, ``block_bytes`` sized
at start-up). ``Sequence.draft_cached`` counts the entries written with TRUE features (reset
when the sequence loses its blocks).

The features are the target's own: the engine's runner keeps every cached position's final
hidden state at its KV slot (``ModelRunner.features``, written by the target's forward in prefill,
plain decode and verify alike, CUDA graphs included; forks copy them with the K/V), so no
position ever needs a second target forward, however it was decoded.

A round, for a sequence of L tokens (target K/V and features valid for positions 0..L-2):
  1. catch up: one packed forward of the head writes entries ``[draft_cached, L - 1]`` (entry p
     reads feature p - 1 from the runner's features, zero for p = 0); its output at L - 1 drafts
     token 1. In the steady state that is the 1..Q positions the last verify pass emitted; after
     decode steps without speculation (the adaptive gate, spec/adaptive.py), or for a new
     sequence, it is every position since (``catch_up_tokens``: a head forward, one layer).
  2. k - 1 one-token steps: entry ``L - 1 + j`` = (draft j, the head's own output of step j - 1).
     These entries hold draft features; the next round's catch-up overwrites them.
Drafts are the head's argmax (``greedy``, vLLM's default for EAGLE) or samples from its processed
distribution (``probabilistic``; a round whose rows are all greedy drafts argmax and hands the
verifier no q: ``draft_model.wants_q``); verification is the unchanged exact rule (``verifier.py``).
On GPU a whole round is ONE CUDA graph per batch bucket up to ``disable_by_batch_size``
(``ASYNCRL_EAGLE_GRAPHS=0``: eager) whenever every row's catch-up is at most ``Q = k + 1`` entries
and none starts at position 0 (the steady state): the catch-up is padded to Q entries per row (a
verify emits 1..Q tokens), their features gathered from the runner's by slot, run by the paged
decode kernel with ``query_len = Q`` (entries past a row's count write the scratch block; their
outputs are never read), then the k - 1 one-token steps; all of the round's host inputs go over
in one copy (``StaticInputs``). A longer catch-up (a new sequence, or after plain decode steps)
runs the round eagerly: catch-up through the gathered path, steps through the paged kernel.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, build_gathered_metadata
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.draft_model import capture_rounds, draft_tokens, sampling_host, wants_q
from asyncrl.engine.spec.eagle_head import load_head
from asyncrl.engine.staging import StaticInputs

# ASYNCRL_EAGLE_GRAPHS=0: the rounds run eagerly on GPU too (for A/B runs, or if a capture fails)
GRAPHS = os.environ.get("ASYNCRL_EAGLE_GRAPHS", "1") != "0"


class EagleProposer:
    """``propose(batch, budgets)`` -> (drafts ``[B, k]`` int64 on the device, counts ``[B]``,
    probs ``[B, k, V]`` or None). Invariant: ``Sequence.draft_cached`` entries of the head's K/V
    hold true features (the target's, read from ``runner.features``)."""

    reads_target_features = True  # the engine's runner records them (ModelRunner(record_features=True))

    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, device, target_config):
        self.k = config.num_speculative_tokens
        self.q = self.k + 1
        self.probabilistic = config.draft_sampling == "probabilistic"
        self.head = load_head(config.model, dtype=dtype, device=device)
        self.head.check_target(target_config)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch = config.disable_by_batch_size
        self.runner = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}       # argmax drafts
        self.prob_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # drafts sampled from q (probabilistic config)
        self.staged: Optional[StaticInputs] = None
        self.vars: dict[str, torch.Tensor] = {}
        # head entries the last propose wrote for rows needing more than one round's Q (a new
        # sequence's prompt, positions decoded without speculation): the proposer's catch-up
        self.catch_up_tokens = 0
        self.rounds = {"graph": 0, "eager": 0}

    def block_bytes(self, block_size: int) -> int:
        """Bytes per KV block: the head's K/V (one layer) and the target features the runner
        records at the block's slots."""
        c = self.head.config
        return (2 * c.num_key_value_heads * c.head_dim + c.hidden_size) * block_size * self.dtype.itemsize

    def attach(self, runner) -> None:
        self.runner = runner
        c, attn = self.head.config, self.head.layers[0].self_attn
        shape = (runner.num_blocks + 1, runner.block_size, c.num_key_value_heads, c.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # the round reaches position L - 1 + k (catch-up: first + k): scratch columns past the table
        self.table_width = runner._bt_width() + -(-(self.q + 1) // runner.block_size)
        self.paged = runner.is_cuda  # the draft steps read K/V in place (Triton); gathered elsewhere
        if self.paged and not runner.config.enforce_eager and GRAPHS:
            self._capture([b for b in runner._graph_sizes() if b <= self.max_batch] or [1])

    def release(self) -> None:
        self.graphs.clear()
        self.prob_graphs.clear()
        attn = self.head.layers[0].self_attn
        attn.k_cache = attn.v_cache = torch.empty(0)

    # ---- one round ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch, budgets: list[int]):
        seqs, B = batch.seqs, len(batch.seqs)
        prob = wants_q(self.probabilistic, seqs)
        L = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        first = np.minimum([s.draft_cached for s in seqs], L - 1)
        entries = L - first
        self.catch_up_tokens = int(entries[entries > self.q].sum())
        bs = min((b for b in self.graphs if b >= B), default=None)
        if bs is not None and (first >= 1).all() and (entries <= self.q).all():
            drafts, probs = self._replay(seqs, first, L, bs, prob)
            drafts, probs = drafts[:B], (probs[:B] if probs is not None else None)
            self.rounds["graph"] += 1
        else:
            drafts, probs = self._eager_round(seqs, first, L, prob)
            self.rounds["eager"] += 1
        for s, n in zip(seqs, L):
            s.draft_cached = int(n)
        return drafts, np.asarray(budgets, dtype=np.int64), probs

    def _eager_round(self, seqs, first: np.ndarray, L: np.ndarray, prob: bool):
        """Catch-up through the gathered path (the head over every entry to write), then the
        k - 1 steps (paged on GPU, gathered on CPU): drafts ``[B, k]``, probs or None."""
        B = len(seqs)
        g = self._catch_up(seqs, first, L)
        dev = {n: torch.from_numpy(a).to(self.device)
               for n, a in sampling_host(seqs, B, self.k, prob).items()}
        tok, q = draft_tokens(self.runner.model.compute_logits(g), dev, 0, prob)
        steps = self._paged_inputs(seqs, L, B) if self.paged else self._gathered_inputs(seqs, L)
        return self._draft_steps({**steps, **dev, "tok": tok, "q": q, "g": g}, prob)

    def _draft_steps(self, v: dict, prob: bool):
        """Drafts 1..k-1 of ``rows`` rows after draft 0: ``v`` has tok ``[rows]`` (draft 0), q
        (its distribution or None), g ``[rows, H]`` (the head output it came from), pos ``[k - 1,
        rows]``, the attention inputs of each step and the sampling arrays. Returns drafts
        ``[rows, k]`` and their q ``[rows, k, V]`` or None."""
        target, tok, g = self.runner.model, v["tok"], v["g"]
        drafts, probs = [tok], [v["q"]]
        for j in range(1, self.k):
            g = self.head(target.model.embed_tokens(tok), g, v["pos"][j - 1], self._meta(v, j - 1))
            tok, q = draft_tokens(target.compute_logits(g), v, j, prob)
            drafts.append(tok)
            probs.append(q)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if prob else None)

    @staticmethod
    def _meta(v: dict, i: int) -> AttentionMetadata:
        if "metas" in v:
            return v["metas"][i]
        # rows of [k - 1, rows] buffers: contiguous, as the cache-write kernel reads slot_mapping
        return AttentionMetadata(slot_mapping=v["slots"][i], block_tables=v["bt"], context_lens=v["ctx"][i],
                                 paged_decode=True)

    def verified(self, batch, out) -> None:
        """Nothing to keep: the verify pass wrote its features into the runner's by itself."""

    def _catch_up(self, seqs, first: np.ndarray, L: np.ndarray) -> torch.Tensor:
        """Write head entries ``[first_i, L_i - 1]`` of every row; g ``[B, H]`` at ``L_i - 1``."""
        r = self.runner
        n = L - first
        feats = self._true_features(seqs, first, L)
        ids = torch.tensor([t for s, a, b in zip(seqs, first, L) for t in s.token_ids[a:b]], device=self.device)
        pos = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in zip(first, L)])).to(self.device)
        meta = build_gathered_metadata([s.block_table for s in seqs], list(first), list(n), r.block_size,
                                       r.scratch_block, self.device)
        g = self.head(r.model.model.embed_tokens(ids), feats, pos, meta)
        return g[torch.from_numpy(np.cumsum(n) - 1).to(self.device)]

    def _true_features(self, seqs, first: np.ndarray, L: np.ndarray) -> torch.Tensor:
        """Packed ``[sum(L - first), H]``: target feature ``p - 1`` for every entry p (zero for p = 0),
        gathered from the runner's features by slot."""
        bsz = self.runner.block_size
        fpos = [np.arange(a - 1, b - 1) for a, b in zip(first, L)]
        slots = np.concatenate([np.asarray(s.block_table, dtype=np.int64)[np.maximum(p, 0) // bsz] * bsz
                                + np.maximum(p, 0) % bsz for s, p in zip(seqs, fpos)])
        feats = self.runner.features[torch.from_numpy(slots).to(self.device)]
        zero = np.concatenate(fpos) < 0  # entry 0 of a sequence: no feature before it
        if zero.any():
            feats[torch.from_numpy(zero).to(self.device)] = 0
        return feats

    def _gathered_inputs(self, seqs, L: np.ndarray) -> dict:
        """CPU: positions ``[k - 1, B]`` (entry ``L - 1 + j`` of draft step j) and each step's gathered
        metadata."""
        r, B = self.runner, len(seqs)
        pos = (L - 1)[None, :] + np.arange(1, self.k)[:, None]
        tables = [s.block_table for s in seqs]
        metas = [build_gathered_metadata(tables, list(p), [1] * B, r.block_size, r.scratch_block, self.device)
                 for p in pos]
        return {"pos": torch.from_numpy(pos).to(self.device), "metas": metas}

    def _paged_host(self, seqs, L: np.ndarray, rows: int) -> dict:
        """GPU step inputs for ``rows`` rows: pos, slots ``[k - 1, rows]`` int64, ctx ``[k - 1, rows]``
        int32, bt ``[rows, W]`` int32. Positions past a row's blocks (drafts beyond its budget, never
        used) and padding rows write and read the scratch block."""
        r, B, bsz = self.runner, len(seqs), self.runner.block_size
        step = np.arange(1, self.k)[:, None]
        pos = np.broadcast_to(step, (self.k - 1, rows)).copy()
        pos[:, :B] += (L - 1)[None, :]
        bt = np.full((rows, self.table_width), r.scratch_block, dtype=np.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_table)] = s.block_table
        slots = _table_slots(bt, np.arange(rows)[None, :], pos, bsz)
        return dict(pos=pos, slots=slots, ctx=(pos + 1).astype(np.int32), bt=bt)

    def _paged_inputs(self, seqs, L: np.ndarray, rows: int) -> dict:
        """``_paged_host`` on the device, in one host->device copy."""
        h = self._paged_host(seqs, L, rows)
        n = self.k - 1
        flat = torch.from_numpy(np.concatenate([h["pos"], h["slots"], h["ctx"], h["bt"].T]).astype(np.int64))
        dev = flat.to(self.device)
        return dict(pos=dev[:n], slots=dev[n:2 * n], ctx=dev[2 * n:3 * n].to(torch.int32),
                    bt=dev[3 * n:].t().contiguous().to(torch.int32))

    # ---- CUDA graphs (GPU: a whole round replayed per batch bucket) -------------------
    def _round_host(self, seqs, first: np.ndarray, L: np.ndarray, rows: int, prob: bool = False) -> dict:
        """Host inputs of a graph round of ``rows`` rows: the catch-up's ``cids, cpos, cslots, feat
        [rows, Q]`` (entry j of row i: position ``first_i + j``, its token, its slot, the slot of its
        feature, position ``first_i + j - 1``, in the runner's features; entries past the row's count
        ``L_i - first_i`` write the scratch block and read any feature), ``cctx [rows]`` int32 and
        ``last [rows]`` (entry ``L_i - 1`` in the packed output); the steps' ``pos, slots, ctx, bt``
        (``_paged_host``); with a probabilistic config the sampling arrays (greedy defaults unless
        ``prob``: the argmax graph reads none). Padding rows: one entry at position 0, scratch."""
        r, B, Q, bsz = self.runner, len(seqs), self.q, self.runner.block_size
        scratch = r.scratch_block * bsz
        h = self._paged_host(seqs, L, rows)
        n, base = np.ones(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        n[:B], base[:B] = L - first, first
        j = np.arange(Q)
        pos = base[:, None] + j[None, :]
        live = j[None, :] < n[:, None]
        ids = np.zeros((rows, Q), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, :n[i]] = s.token_ids[first[i]:L[i]]
        at = np.arange(rows)[:, None]
        slots = np.where(live, _table_slots(h["bt"], at, pos, bsz), scratch)
        feat = np.where(live & (pos >= 1), _table_slots(h["bt"], at, np.maximum(pos - 1, 0), bsz), scratch)
        out = dict(cids=ids, cpos=pos, cslots=slots, feat=feat, cctx=(base + Q).astype(np.int32),
                   last=np.arange(rows) * Q + n - 1, **h)
        if self.probabilistic:  # one staged layout for both graphs of a bucket
            out.update(sampling_host(seqs, rows, self.k, prob))
        return out

    def _replay(self, seqs, first: np.ndarray, L: np.ndarray, bs: int, prob: bool):
        self.staged.put(bs, self._round_host(seqs, first, L, bs, prob))  # every input: one copy
        (self.prob_graphs if prob else self.graphs)[bs].replay()
        return self.vars["drafts"][:bs], (self.vars["probs"][:bs] if prob else None)

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        V, none = self.head.config.vocab_size, np.zeros(0, dtype=np.int64)
        max_bs = max(sizes)
        self.staged = StaticInputs.padded({bs: self._round_host([], none, none, bs) for bs in sizes}, self.device)
        self.vars = dict(drafts=torch.zeros(max_bs, self.k, dtype=torch.int64, device=self.device))
        capture_rounds(self, sizes, V)

    def _graph_round(self, bs: int, prob: bool) -> None:
        """A round of ``bs`` rows on the graph buffers (what a bucket's graph holds): the padded
        catch-up (the paged kernel, ``query_len = Q``), draft 0 from each row's entry ``L - 1``,
        then the k - 1 steps."""
        v, target, Q = self.staged.views(bs), self.runner.model, self.q
        meta = AttentionMetadata(slot_mapping=v["cslots"].view(-1), block_tables=v["bt"], context_lens=v["cctx"],
                                 paged_decode=True, query_len=Q)
        feats = self.runner.features[v["feat"].view(-1)]
        g = self.head(target.model.embed_tokens(v["cids"].view(-1)), feats, v["cpos"].view(-1), meta)[v["last"]]
        tok, q = draft_tokens(target.compute_logits(g), v, 0, prob)
        drafts, probs = self._draft_steps({**v, "tok": tok, "q": q, "g": g}, prob)
        self.vars["drafts"][:bs].copy_(drafts)
        if probs is not None:
            self.vars["probs"][:bs].copy_(probs)


def _table_slots(bt: np.ndarray, rows: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """KV slot (int64) of position ``pos`` of row ``rows`` (broadcast together) in the padded block
    table ``bt [rows, W]``: ``bt[row, p // block_size] * block_size + p % block_size``; positions past
    the table read its last column (the padding's scratch block)."""
    blk = bt[rows, np.minimum(pos // block_size, bt.shape[1] - 1)].astype(np.int64)
    return blk * block_size + pos % block_size
