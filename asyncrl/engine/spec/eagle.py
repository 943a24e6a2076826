"""EAGLE proposer: the draft head (``eagle_head.py``) drafts k tokens from the target's features.

Head entry p = (token p, target feature p - 1) lives in the head's own one-layer K/V pool with
the target's block geometry (the draft-model layout: same block tables, ``block_bytes`` sized
at start-up). ``Sequence.draft_cached`` counts the entries written with TRUE features (reset
when the sequence loses its blocks).

A round, for a sequence of L tokens (target K/V valid for positions 0..L-2):
  1. catch up: one packed forward writes entries ``[draft_cached, L - 1]`` with true features;
     its output at L - 1 drafts token 1. The features come from the previous verify pass
     (``verified`` keeps the accepted positions' target hidden states: exactly the ones the
     next catch-up needs), else from a target forward over the missing positions that reads
     the target's cached K/V and writes nothing (its K/V writes go to the scratch block): the
     first speculative step of a sequence, or after decode steps without speculation.
  2. k - 1 one-token steps: entry ``L - 1 + j`` = (draft j, the head's own output of step j - 1).
     These entries hold draft features; the next round's catch-up overwrites them.
Drafts are the head's argmax (``greedy``, vLLM's default for EAGLE) or samples from its processed
distribution (``probabilistic``); verification is the unchanged exact rule (``verifier.py``).
On GPU the k - 1 single-token steps (each one layer plus the target's LM head) replay one CUDA graph
per batch bucket up to ``disable_by_batch_size`` (``ASYNCRL_EAGLE_GRAPHS=0``: eager); the catch-up,
of variable length, runs eagerly through the gathered path.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, build_gathered_metadata
from asyncrl.engine.cuda_graphs import capture_graphs
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.draft_model import draft_tokens, sampling_host
from asyncrl.engine.spec.eagle_head import load_head

# ASYNCRL_EAGLE_GRAPHS=0: the draft steps run eagerly on GPU too (for A/B runs, or if a capture fails)
GRAPHS = os.environ.get("ASYNCRL_EAGLE_GRAPHS", "1") != "0"


class EagleProposer:
    """``propose(batch, budgets)`` -> (drafts ``[B, k]`` int64 on the device, counts ``[B]``,
    probs ``[B, k, V]`` or None); ``verified(batch, out)`` keeps the accepted features.
    Invariant: ``features[seq_id] = (first, [n, H])`` holds target features of positions
    ``first .. first + n - 1`` of a sequence that ran in the last round."""

    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, device, target_config):
        self.k = config.num_speculative_tokens
        self.probabilistic = config.draft_sampling == "probabilistic"
        self.head = load_head(config.model, dtype=dtype, device=device)
        self.head.check_target(target_config)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch = config.disable_by_batch_size
        self.runner = None
        self.features: dict[int, tuple[int, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.vars: dict[str, torch.Tensor] = {}

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of the head (one layer, K and V)."""
        c = self.head.config
        return 2 * block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def attach(self, runner) -> None:
        self.runner = runner
        c, attn = self.head.config, self.head.layers[0].self_attn
        shape = (runner.num_blocks + 1, runner.block_size, c.num_key_value_heads, c.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.table_width = runner._bt_width() + -(-(self.k + 1) // runner.block_size)
        self.paged = runner.is_cuda  # the draft steps read K/V in place (Triton); gathered elsewhere
        if self.paged and not runner.config.enforce_eager and self.k > 1 and GRAPHS:
            self._capture([b for b in runner._graph_sizes() if b <= self.max_batch] or [1])

    def release(self) -> None:
        self.graphs.clear()
        attn = self.head.layers[0].self_attn
        attn.k_cache = attn.v_cache = torch.empty(0)
        self.features.clear()

    # ---- one round ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch, budgets: list[int]):
        seqs, target = batch.seqs, self.runner.model
        self.features = {s.seq_id: self.features[s.seq_id] for s in seqs if s.seq_id in self.features}
        B = len(seqs)
        L = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        first = np.minimum([s.draft_cached for s in seqs], L - 1)
        g = self._catch_up(seqs, first, L)
        bs = min((b for b in self.graphs if b >= B), default=None)
        sampling = sampling_host(seqs, B if bs is None else bs, self.k, self.probabilistic)
        dev = {n: torch.from_numpy(a).to(self.device) for n, a in sampling.items()}
        tok, q = draft_tokens(target.compute_logits(g), {n: t[:B] for n, t in dev.items()}, 0, self.probabilistic)
        drafts, probs = tok[:, None], (q[:, None] if q is not None else None)
        if self.k > 1:
            if bs is not None:
                later, later_q = self._replay(seqs, L, tok, g, sampling, bs)
            else:
                steps = self._paged_inputs(seqs, L, B) if self.paged else self._gathered_inputs(seqs, L)
                later, later_q = self._steps({**steps, **dev, "tok": tok, "g": g})
            drafts = torch.cat([drafts, later[:B]], 1)
            probs = torch.cat([probs, later_q[:B]], 1) if probs is not None else None
        for s, n in zip(seqs, L):
            s.draft_cached = int(n)
        return drafts, np.asarray(budgets, dtype=np.int64), probs

    def _steps(self, v: dict):
        """Draft steps 1..k-1 of ``rows`` rows (the part a CUDA graph holds on GPU): ``v`` has tok
        ``[rows]`` (draft 0), g ``[rows, H]`` (the head output it came from), pos ``[k - 1, rows]``,
        the attention inputs of each step and the sampling arrays. Returns drafts ``[rows, k - 1]``
        and their q ``[rows, k - 1, V]`` or None."""
        target, tok, g = self.runner.model, v["tok"], v["g"]
        drafts, probs = [], []
        for j in range(1, self.k):
            g = self.head(target.model.embed_tokens(tok), g, v["pos"][j - 1], self._meta(v, j - 1))
            tok, q = draft_tokens(target.compute_logits(g), v, j, self.probabilistic)
            drafts.append(tok)
            probs.append(q)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if self.probabilistic else None)

    @staticmethod
    def _meta(v: dict, i: int) -> AttentionMetadata:
        if "metas" in v:
            return v["metas"][i]
        # rows of [k - 1, rows] buffers: contiguous, as the cache-write kernel reads slot_mapping
        return AttentionMetadata(slot_mapping=v["slots"][i], block_tables=v["bt"], context_lens=v["ctx"][i],
                                 paged_decode=True)

    def verified(self, batch, out) -> None:
        """Keep the target features of each row's emitted positions ``L - 1 .. L - 2 + emitted``
        (the verify pass's hidden states): the next catch-up's true features."""
        Q = self.k + 1
        for i, (seq, toks) in enumerate(zip(batch.seqs, out.tokens)):
            self.features[seq.seq_id] = (batch.starts[i], out.hidden[i * Q: i * Q + len(toks)].clone())

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
        """Packed ``[sum(L - first), H]``: target feature ``p - 1`` for every entry p (zero for p = 0)."""
        out, missing = [], []
        for i, (s, a, b) in enumerate(zip(seqs, first, L)):
            lo, hi = a - 1, b - 2  # features needed: positions lo..hi (lo = -1: the zero feature)
            have = self.features.get(s.seq_id)
            if have is not None and have[0] <= max(lo, 0) and hi < have[0] + len(have[1]):
                out.append(have[1][max(lo, 0) - have[0]: hi + 1 - have[0]])
            else:
                out.append(None)
                missing.append((i, s, max(lo, 0), hi))
        for (i, *_), f in zip(missing, self._target_hidden([m[1:] for m in missing])):
            out[i] = f
        H = self.head.config.hidden_size
        zero = torch.zeros(1, H, dtype=self.dtype, device=self.device)
        return torch.cat([torch.cat([zero, f]) if a == 0 else f for f, a in zip(out, first)])

    def _target_hidden(self, rows: list[tuple]) -> list[torch.Tensor]:
        """Target hidden states ``[b - a + 1, H]`` of positions ``[a, b]`` for each ``(seq, a, b)`` (empty
        when b < a), in one forward that reads the target's cached K/V and writes its own to the
        scratch block (the cached K/V, and so the target's later tokens, stay untouched)."""
        live = [(s, a, b) for s, a, b in rows if b >= a]
        hidden = iter(())
        if live:
            r = self.runner
            n = [b - a + 1 for _, a, b in live]
            ids = torch.tensor([t for s, a, b in live for t in s.token_ids[a:b + 1]], device=self.device)
            pos = torch.tensor([p for _, a, b in live for p in range(a, b + 1)], device=self.device)
            meta = build_gathered_metadata([s.block_table for s, _, _ in live], [a for _, a, _ in live], n,
                                           r.block_size, r.scratch_block, self.device)
            meta.slot_mapping = torch.full_like(meta.slot_mapping, r.scratch_block * r.block_size)
            hidden = iter(r.model(ids, pos, meta).split(n))
        empty = torch.zeros(0, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        return [next(hidden) if b >= a else empty for _, a, b in rows]

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
        blk = bt[np.arange(rows)[None, :], np.minimum(pos // bsz, bt.shape[1] - 1)].astype(np.int64)
        return dict(pos=pos, slots=blk * bsz + pos % bsz, ctx=(pos + 1).astype(np.int32), bt=bt)

    def _paged_inputs(self, seqs, L: np.ndarray, rows: int) -> dict:
        """``_paged_host`` on the device, in one host->device copy."""
        h = self._paged_host(seqs, L, rows)
        n = self.k - 1
        flat = torch.from_numpy(np.concatenate([h["pos"], h["slots"], h["ctx"], h["bt"].T]).astype(np.int64))
        dev = flat.to(self.device)
        return dict(pos=dev[:n], slots=dev[n:2 * n], ctx=dev[2 * n:3 * n].to(torch.int32),
                    bt=dev[3 * n:].t().contiguous().to(torch.int32))

    # ---- CUDA graphs (GPU: draft steps 1..k-1 replayed per batch bucket) -------------
    _STEP_MAJOR = ("pos", "slots", "ctx")  # [k - 1, rows] buffers: rows are sliced on dim 1

    def _view(self, bs: int) -> dict:
        return {n: (t[:, :bs] if n in self._STEP_MAJOR else t[:bs]) for n, t in self.vars.items()}

    def _replay(self, seqs, L: np.ndarray, tok: torch.Tensor, g: torch.Tensor, sampling: dict, bs: int):
        B, v = len(seqs), self._view(bs)
        for name, a in {**self._paged_host(seqs, L, bs), **sampling}.items():
            v[name].copy_(torch.from_numpy(np.ascontiguousarray(a)))
        v["tok"][:B].copy_(tok)
        v["g"][:B].copy_(g)
        self.graphs[bs].replay()
        return v["drafts"], (v["probs"] if self.probabilistic else None)

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        max_bs, H = max(sizes), self.head.config.hidden_size
        host = {**self._paged_host([], np.zeros(0, dtype=np.int64), max_bs),
                **sampling_host([], max_bs, self.k, self.probabilistic)}
        self.vars = {n: torch.from_numpy(a).to(self.device) for n, a in host.items()}
        self.vars.update(tok=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
                         g=torch.zeros(max_bs, H, dtype=self.dtype, device=self.device),
                         drafts=torch.zeros(max_bs, self.k - 1, dtype=torch.int64, device=self.device))
        if self.probabilistic:
            self.vars["probs"] = torch.zeros(max_bs, self.k - 1, self.head.config.vocab_size, dtype=torch.float32,
                                             device=self.device)
        self.graphs.update(capture_graphs(sizes, self._graph_steps)[0])

    def _graph_steps(self, bs: int) -> None:
        """Steps 1..k-1 of ``bs`` rows on the graph buffers (what a bucket's graph holds)."""
        v = self._view(bs)
        drafts, probs = self._steps(v)
        v["drafts"].copy_(drafts)
        if probs is not None:
            v["probs"].copy_(probs)
