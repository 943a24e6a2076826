"""BlockManager: fixed-size KV blocks, reference counts, a hash-chained prefix cache
and an explicit fork for the n samples of one prompt.

Invariants (checked by ``check_invariants``, exercised by the hypothesis tests):
  * every block is either free (``ref_count == 0``, in ``free``) or used
    (``ref_count`` = number of live block-table entries that point at it);
  * ``hash_to_block[h] = b`` implies ``blocks[b].hash == h`` and ``b`` holds exactly
    the tokens ``blocks[b].token_ids`` (a full block whose K/V have been written);
  * a cache hit is only taken after comparing token ids (hash collisions can't alias).

Prefix cache: block i's hash is ``hash((hash of block i-1, tokens of block i))`` with the
chain rooted at ``namespace`` (the weight version), so K/V computed under older weights
is never reused after ``set_namespace``. Freed blocks keep their hash and stay findable
until reused; ``free`` is an insertion-ordered dict used as an LRU queue (blocks are
freed tail-first, so a prompt's head outlives its tail).

Block-table rows (with ``max_blocks_per_seq``): every sequence holding blocks also owns
row ``seq.table_row`` of the numpy array ``tables [rows, max_blocks_per_seq]`` int32,
kept equal to its ``block_table`` (padded with ``num_blocks``, the scratch block id) as
blocks are added, so a decode step gathers its batch's tables in one indexing op instead
of a Python loop over sequences.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np

from asyncrl.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: Optional[int] = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_blocks_per_seq: Optional[int] = None):
        self.block_size = block_size
        self.pad = num_blocks  # table padding: the runner's scratch block
        self.tables = None if max_blocks_per_seq is None else np.full((64, max_blocks_per_seq), num_blocks, np.int32)
        self.free_rows = [] if self.tables is None else list(range(63, -1, -1))
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = 0
        self.cache_hit_tokens = 0  # metrics
        self.forked_tokens = 0

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _chain(self, prev: Optional[int], tokens: list[int]) -> int:
        return hash((self.namespace if prev is None else prev, tuple(tokens)))

    def _lookup(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (full blocks only, and at
        least one token left to compute so the step yields logits)."""
        if not self.enable_prefix_caching:
            return []
        hits, prev = [], None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = self._chain(prev, tokens)
            b = self.hash_to_block.get(h)
            if b is None or self.blocks[b].token_ids != tuple(tokens):
                break
            hits.append(b)
            prev = h
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._lookup(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks_needed(self.block_size) - len(hits) + revived <= self.num_free_blocks

    # ---- block-table rows ------------------------------------------------------
    def _bind_row(self, seq: Sequence) -> None:
        """Give ``seq`` (which just got its blocks) a table row holding them."""
        if self.tables is None:
            return
        if not self.free_rows:  # grow: double the rows
            n = len(self.tables)
            self.tables = np.concatenate([self.tables, np.full_like(self.tables, self.pad)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        row = seq.table_row = self.free_rows.pop()
        self.tables[row] = self.pad
        self.tables[row, :len(seq.block_table)] = seq.block_table

    def _unbind_row(self, seq: Sequence) -> None:
        if self.tables is not None and seq.table_row >= 0:
            self.free_rows.append(seq.table_row)
        seq.table_row = -1

    # ---- mutations -----------------------------------------------------------
    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        block = self.blocks[b]
        if block.hash is not None and self.hash_to_block.get(block.hash) == b:
            del self.hash_to_block[block.hash]  # evict its cache entry
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return b

    def _ref(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self.free[b]  # revive a cached free block
        block.ref_count += 1

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` (no blocks yet) all blocks for its tokens, reusing cached ones.
        Sets ``seq.num_cached_tokens`` to the number of tokens found in the cache."""
        assert not seq.block_table and self.can_allocate(seq)
        hits = self._lookup(seq)
        for b in hits:
            self._ref(b)
        seq.block_table = hits + [self._take_free() for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]
        self._bind_row(seq)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.cache_hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[b] = None
        seq.block_table = []
        self._unbind_row(seq)
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks, seq.last_hash = 0, None
        seq.draft_cached = 0  # a draft model's K/V lived in these blocks too (spec/draft_model.py)

    def _blocks_to_append(self, seq: Sequence, num_tokens: int) -> int:
        # ``num_tokens`` counts a pending token (sampled, id not on the host yet): its
        # position is what the next decode step writes
        return seq.num_blocks_needed(self.block_size, seq.num_tokens + num_tokens - 1) - len(seq.block_table)

    def can_append(self, seq: Sequence, num_tokens: int = 1) -> bool:
        return self._blocks_to_append(seq, num_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_tokens: int = 1) -> None:
        """Ensure blocks for ``seq.num_tokens + num_tokens - 1`` tokens: a decode step
        writes the K/V of the last token (position num_tokens-1), plus any speculative extras."""
        for _ in range(self._blocks_to_append(seq, num_tokens)):
            seq.block_table.append(self._take_free())
            if self.tables is not None:
                self.tables[seq.table_row, len(seq.block_table) - 1] = seq.block_table[-1]

    def hash_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of ``seq`` whose K/V is written (or being written by a
        launched step: any reader is a later step on the same stream) and whose token ids
        the host knows. Incremental: blocks below ``seq.num_hashed_blocks`` are done, so a
        step costs O(new blocks), not O(context)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens, len(seq.token_ids)) // self.block_size
        prev = seq.last_hash
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = seq.block_tokens(i, self.block_size)
                block.hash, block.token_ids = self._chain(prev, tokens), tuple(tokens)
                self.hash_to_block.setdefault(block.hash, block.block_id)
            prev = block.hash
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks, seq.last_hash = full, prev

    def fork_cost(self, parent: Sequence) -> int:
        """Free blocks one fork of ``parent`` takes: 1 if its last block is partial."""
        return 1 if len(parent) % self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> Optional[tuple[int, int, int]]:
        """Share ``parent``'s full blocks with ``child``; give the child a private copy
        of the partial last block. Returns ``(src_block, dst_block, num_tokens)`` to copy
        on the device (after the forward that writes the parent's K/V; only the first
        ``num_tokens`` slots hold K/V, the child writes the rest itself), or None.

        Pre: ``child`` has the parent's tokens, no blocks; parent's prompt K/V is (or is
        being) computed in ``parent.block_table``."""
        assert not child.block_table and len(child) == len(parent)
        full = len(parent) // self.block_size
        for b in parent.block_table[:full]:
            self._ref(b)
        child.block_table = list(parent.block_table[:full])
        copy = None
        if len(parent) % self.block_size:
            dst = self._take_free()
            child.block_table.append(dst)
            copy = (parent.block_table[full], dst, len(parent) % self.block_size)
        self._bind_row(child)
        child.num_cached_tokens = len(parent)
        self.forked_tokens += len(parent)
        return copy

    def set_namespace(self, namespace: int) -> None:
        """New weights: cached K/V is stale. Drop the index; new chains root elsewhere."""
        self.namespace = namespace
        # only the indexed blocks could be found again; visiting them, not every free block, keeps a
        # weight sync's cost independent of the pool's size (the CPU quickstart syncs every step).
        # A free block left with an old hash (a duplicate the index never held) is reset when taken.
        for b in self.hash_to_block.values():
            block = self.blocks[b]
            if block.ref_count == 0:
                block.hash, block.token_ids = None, ()
        self.hash_to_block.clear()

    # ---- checks --------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * len(self.blocks)
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block.block_id, block.ref_count, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free)
        for h, b in self.hash_to_block.items():
            assert self.blocks[b].hash == h and len(self.blocks[b].token_ids) == self.block_size
        if self.tables is not None:  # table rows mirror block tables; free and used rows disjoint
            rows = [s.table_row for s in live if s.block_table]
            assert len(set(rows)) == len(rows) and not set(rows) & set(self.free_rows)
            assert len(rows) + len(self.free_rows) == len(self.tables)
            for s in live:
                if s.block_table:
                    assert self.tables[s.table_row, :len(s.block_table)].tolist() == s.block_table
