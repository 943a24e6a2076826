"""StateSlotManager: block-table rows are recurrent-state slots, bounded, counted in admission."""
import math

import torch

from asyncrl.engine.sequence import Sequence
from asyncrl.engine.state_pool import StatePool, StateSlotManager
from asyncrl.types import SamplingParams


def _seq(n=5):
    return Sequence(list(range(4, 4 + n)), SamplingParams(), "r", 0, 0)


def test_slots_bound_admission_and_forks():
    bm = StateSlotManager(num_blocks=32, block_size=4, max_blocks_per_seq=8, num_slots=2)
    assert not bm.enable_prefix_caching
    a, b, c = _seq(), _seq(), _seq()
    bm.allocate(a)
    assert bm.fork_cost(a) == 1  # a partial last block to copy, and a slot is free
    bm.allocate(b)
    assert {a.table_row, b.table_row} == {0, 1}
    assert not bm.can_allocate(c) and bm.fork_cost(a) == math.inf  # blocks are free, slots are not
    bm.deallocate(a)
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.table_row == 0  # the freed slot
    bm.check_invariants([b, c])


class _Layer:
    conv_dim, kernel, num_v_heads, head_k_dim, head_v_dim = 6, 4, 2, 3, 5


def test_pool_copies_states_between_slots():
    layers = [_Layer(), _Layer()]
    pool = StatePool(layers, num_slots=3, dtype=torch.float32, device=torch.device("cpu"))
    assert layers[0].ssm_state.shape == (4, 2, 3, 5) and layers[1].conv_state.shape == (4, 6, 3)
    for conv, ssm in zip(pool.conv, pool.ssm):
        conv[1].normal_()
        ssm[1].normal_()
    pool.copy(torch.tensor([1, 1]), torch.tensor([0, 2]))
    for conv, ssm in zip(pool.conv, pool.ssm):
        assert torch.equal(conv[0], conv[1]) and torch.equal(ssm[2], ssm[1]) and ssm[3].abs().sum() == 0
    assert StatePool.bytes_per_slot(layers, torch.float32) == 2 * (6 * 3 * 4 + 2 * 3 * 5 * 4)
