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
Eager (no CUDA graph yet): per round one packed forward and k - 1 single-token forwards of one
layer, each with the target's LM head (a 151,936-row head costs as much as the layer at batch 8).
"""
from __future__ import annotations

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, build_gathered_metadata
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.draft_model import draft_tokens, sampling_host
from asyncrl.engine.spec.eagle_head import load_head


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
        self.runner = None
        self.features: dict[int, tuple[int, torch.Tensor]] = {}

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

    def release(self) -> None:
        attn = self.head.layers[0].self_attn
        attn.k_cache = attn.v_cache = torch.empty(0)
        self.features.clear()

    # ---- one round ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch, budgets: list[int]):
        seqs, target = batch.seqs, self.runner.model
        self.features = {s.seq_id: self.features[s.seq_id] for s in seqs if s.seq_id in self.features}
        L = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        first = np.minimum([s.draft_cached for s in seqs], L - 1)
        g = self._catch_up(seqs, first, L)
        dev = {n: torch.from_numpy(a).to(self.device) for n, a in sampling_host(seqs, len(seqs), self.k,
                                                                               self.probabilistic).items()}
        tok, q = draft_tokens(target.compute_logits(g), dev, 0, self.probabilistic)
        drafts, probs = [tok], [q]
        steps = self._step_metas(seqs, L)
        for j in range(1, self.k):
            positions, meta = steps[j - 1]
            g = self.head(target.model.embed_tokens(tok), g, positions, meta)
            tok, q = draft_tokens(target.compute_logits(g), dev, j, self.probabilistic)
            drafts.append(tok)
            probs.append(q)
        for s, n in zip(seqs, L):
            s.draft_cached = int(n)
        counts = np.asarray(budgets, dtype=np.int64)
        return torch.stack(drafts, 1), counts, (torch.stack(probs, 1) if self.probabilistic else None)

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

    def _step_metas(self, seqs, L: np.ndarray) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """(positions ``[B]``, metadata) of the k - 1 draft steps, entry ``L - 1 + j`` per row: paged
        decode on GPU (every step's inputs in one host->device copy), gathered elsewhere. Positions
        past a row's blocks (drafts beyond its budget, never used) write and read the scratch block."""
        r, B = self.runner, len(seqs)
        pos = (L - 1)[None, :] + np.arange(1, self.k)[:, None]  # [k - 1, B]
        if not self.paged:
            tables = [s.block_table for s in seqs]
            return [(torch.from_numpy(p).to(self.device),
                     build_gathered_metadata(tables, list(p), [1] * B, r.block_size, r.scratch_block, self.device))
                    for p in pos]
        bsz = r.block_size
        bt = np.full((B, self.table_width), r.scratch_block, dtype=np.int64)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_table)] = s.block_table
        blk = bt[np.arange(B)[None, :], np.minimum(pos // bsz, bt.shape[1] - 1)]
        host = np.concatenate([pos, blk * bsz + pos % bsz, pos + 1, bt.T]).astype(np.int64)  # one copy
        dev = torch.from_numpy(np.ascontiguousarray(host)).to(self.device)
        n = self.k - 1
        pos_d, slots_d, ctx_d = dev[:n], dev[n:2 * n], dev[2 * n:3 * n].to(torch.int32)
        bt_d = dev[3 * n:].t().contiguous().to(torch.int32)
        return [(pos_d[j], AttentionMetadata(slot_mapping=slots_d[j], block_tables=bt_d, context_lens=ctx_d[j],
                                             paged_decode=True)) for j in range(n)]
