"""BlockManager invariants under random allocate / append / fork / free sequences.

Besides the bookkeeping invariants (``check_invariants``), the state machine simulates
the KV content of every block and checks that each live sequence's cached positions
hold its own tokens: a shared or revived block must never be overwritten under it.
"""
import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrl.engine.block_manager import BlockManager
from asyncrl.engine.sequence import Sequence
from asyncrl.types import SamplingParams

BS, NB = 4, 12
PARAMS = SamplingParams()


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NB, BS, max_blocks_per_seq=NB)  # with table rows (checked by the invariant)
        self.live: list[Sequence] = []
        self.content = {b: [None] * BS for b in range(NB)}

    def _write(self, seq: Sequence, start: int, end: int):
        for p in range(start, end):
            self.content[seq.block_table[p // BS]][p % BS] = seq.token_ids[p]

    def _compute(self, seq: Sequence, upto: int):
        """Simulate the forward writing K/V for positions [num_cached, upto)."""
        self._write(seq, seq.num_cached_tokens, upto)
        seq.num_cached_tokens = upto
        self.bm.hash_full_blocks(seq)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def add(self, tokens):
        seq = Sequence(tokens, PARAMS, "r", 0, 0)
        if self.bm.can_allocate(seq):
            self.bm.allocate(seq)
            assert seq.num_cached_tokens < len(seq)  # always >= 1 token to compute
            self._compute(seq, len(seq))
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 1))
    def append(self, i, tok):
        seq = self.live[i % len(self.live)]
        seq.token_ids.append(tok)  # sampled token; its K/V is computed by the next step
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
            self._compute(seq, len(seq))
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.live[i % len(self.live)]
        if parent.num_completion_tokens or self.bm.fork_cost(parent) > self.bm.num_free_blocks:
            return
        child = parent.fork(1, 0)
        copy = self.bm.fork(parent, child)
        if copy:
            self.content[copy[1]] = list(self.content[copy[0]])
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.bm.deallocate(self.live.pop(i % len(self.live)))

    @rule()
    def new_version(self):
        self.bm.set_namespace(self.bm.namespace + 1)

    @invariant()
    def bookkeeping(self):
        self.bm.check_invariants(self.live)

    @invariant()
    def cached_content_is_own(self):
        for seq in self.live:
            for p in range(seq.num_cached_tokens):
                assert self.content[seq.block_table[p // BS]][p % BS] == seq.token_ids[p]


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_requires_equal_tokens():
    """A forged hash entry pointing at a block with other tokens is not a hit."""
    bm = BlockManager(8, BS)
    a = Sequence([1, 2, 3, 4, 5], PARAMS, "a", 0, 0)
    bm.allocate(a)
    a.num_cached_tokens = 5
    bm.hash_full_blocks(a)
    b = Sequence([1, 2, 3, 4, 9], PARAMS, "b", 0, 0)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)  # simulate a hash collision
    c = Sequence([1, 2, 3, 4, 9], PARAMS, "c", 0, 0)
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS, "a", 0, 0)
    bm.allocate(a)
    a.num_cached_tokens = 9
    bm.hash_full_blocks(a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0], PARAMS, "b", 0, 0)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 1
