"""n-gram / prompt-lookup drafting: no extra model, no weights to sync, no drift.

For each sequence, the last ``n`` tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are searched for earlier in the sequence (prompt and completion);
the tokens that followed the most recent earlier match are proposed (up to the row's
budget). With ``group_lookup`` the request's sibling samples (the GRPO group, same prompt)
are searched next: their completions are the "earlier rollouts of the same prompt" that
history-based drafters (DAS, arXiv 2511.13841) exploit. Drafts are deterministic, so the
verifier's one-hot rule applies.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from asyncrl.engine.sequence import Sequence


def _find(hay: np.ndarray, needle: np.ndarray, before: int) -> int:
    """Start of the last occurrence of ``needle`` in ``hay[:before]`` (whole), or -1."""
    n = len(needle)
    if before < n:
        return -1
    # candidates by the first token, narrowed token by token: one pass over the history instead of
    # comparing every n-token window (the H200 n-gram round spent ~1 ms of host time per 8 rows here)
    cand = np.flatnonzero(hay[:before - n + 1] == needle[0])
    for j in range(1, n):
        cand = cand[hay[cand + j] == needle[j]]
    return int(cand[-1]) if len(cand) else -1


def _continuation(tokens: np.ndarray, start: int, k: int) -> np.ndarray:
    """``k`` tokens continuing the sequence after a match whose continuation begins at ``start``:
    ``tokens[start:]``, and past the end the same pattern again (an overlapping copy, as LZ77
    decodes one). The most recent match of a repeating text overlaps the suffix itself: a period
    of p tokens has its match p tokens back, so without the copy only p tokens were proposed (one
    for a repeated token: k had no effect, the H200 bench's 1.9 tokens per step at k = 4)."""
    period = len(tokens) - start  # >= 1: a match ends before the suffix's last token
    return tokens[start + np.arange(k) % period]


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int, others: tuple[np.ndarray, ...] = ()) -> np.ndarray:
    """Up to ``k`` draft tokens continuing ``tokens`` ``[L]`` int64: for the longest suffix of
    length ``n_max..n_min`` found earlier in ``tokens`` (then in each of ``others``), the
    tokens that followed it. Empty when nothing matches."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # in the sequence itself: a match must end before the suffix starts to propose anything
        i = _find(tokens, suffix, L - 1)
        if i >= 0:
            return _continuation(tokens, i + n, k)
        for other in others:
            i = _find(other, suffix, len(other) - 1)
            if i >= 0:
                return other[i + n: i + n + k]
    return tokens[:0]


class NgramProposer:
    """``propose(batch, budgets)`` -> (draft ids ``[B, K]`` int64, counts ``[B]`` int64, None),
    host numpy; row i proposes at most ``budgets[i]`` tokens."""

    def __init__(self, k: int, n_max: int, n_min: int, group_lookup: bool = True):
        self.k, self.n_max, self.n_min, self.group_lookup = k, n_max, n_min, group_lookup
        self.arrays: dict[int, np.ndarray] = {}  # seq_id -> its tokens so far (capacity-doubled buffer)
        self.lengths: dict[int, int] = {}

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """``seq.token_ids`` as int64 numpy, extended by the tokens appended since the last call
        (converting a 2,000-token list every round cost ~50 us per row; tokens only ever append)."""
        n, have = len(seq.token_ids), self.lengths.get(seq.seq_id, 0)
        buf = self.arrays.get(seq.seq_id)
        if buf is None or have > n:
            buf, have = np.empty(max(2 * n, 64), dtype=np.int64), 0
        elif n > len(buf):
            buf = np.concatenate([buf[:have], np.empty(n, dtype=np.int64)])
        buf[have:n] = seq.token_ids[have:n]
        self.arrays[seq.seq_id], self.lengths[seq.seq_id] = buf, n
        return buf[:n]

    def propose(self, batch, budgets: list[int]) -> tuple[np.ndarray, np.ndarray, Optional[object]]:
        seqs: list[Sequence] = batch.seqs
        ids = np.zeros((len(seqs), self.k), dtype=np.int64)
        counts = np.zeros(len(seqs), dtype=np.int64)
        live = {s.seq_id for s in seqs} | {g.seq_id for s in seqs for g in s.group} if self.group_lookup else \
            {s.seq_id for s in seqs}
        for gone in [i for i in self.arrays if i not in live]:  # finished sequences: drop their buffers
            del self.arrays[gone], self.lengths[gone]
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            if budget <= 0:
                continue
            toks = self._tokens(seq)
            others = ()
            if self.group_lookup and len(seq.group) > 1:
                others = tuple(self._tokens(s) for s in seq.group if s is not seq and s.num_completion_tokens > 0)
            draft = lookup(toks, budget, self.n_max, self.n_min, others)
            ids[i, :len(draft)] = draft
            counts[i] = len(draft)
        return ids, counts, None

    def verified(self, batch, out) -> None:
        """Nothing to update: the drafts come from the token history alone."""
