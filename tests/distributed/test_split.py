"""Rows per rank: whole groups, every row exactly once, balanced by tokens, and the same number
of micro-batches on every rank (padding where a rank has fewer)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.distributed.split import group_runs, pad_plan, split_rows


def test_group_runs_are_the_contiguous_runs_of_equal_ids():
    assert group_runs(torch.tensor([4, 4, 1, 1, 1, 4])) == [(0, 2), (2, 5), (5, 6)]
    assert group_runs(torch.tensor([], dtype=torch.long)) == []


def test_uneven_split_by_tokens():
    # 3 groups of 2 rows; costs (tokens) 10+10, 1+1, 4+4: total 30, midpoints 10, 21, 26
    # -> 10/30*2 = 0.67 -> rank 0; 21/30*2 = 1.4 and 26/30*2 = 1.73 -> rank 1
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    cost = torch.tensor([10, 10, 1, 1, 4, 4])
    shares = split_rows(torch.arange(6), group, cost, 2)
    assert [s.tolist() for s in shares] == [[0, 1], [2, 3, 4, 5]]


def test_fewer_groups_than_ranks_leaves_ranks_without_rows():
    group = torch.tensor([0, 0, 1, 1])
    shares = split_rows(torch.arange(4), group, torch.ones(4), 4)
    assert sum(len(s) for s in shares) == 4 and sum(len(s) == 0 for s in shares) == 2


def test_a_group_cut_by_a_mini_batch_boundary_is_split_there():
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    rows = torch.arange(2, 6)  # the second mini-batch starts inside group 0
    shares = split_rows(rows, group, torch.ones(6), 2)
    assert [s.tolist() for s in shares] == [[2], [3, 4, 5]]


def test_plans_are_padded_to_the_busiest_rank():
    a, b, c = torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3])
    plans = [[a, b], [c], []]
    padded = [pad_plan(plans, r) for r in range(3)]
    assert [len(p) for p in padded] == [2, 2, 2]
    assert padded[0] == [a, b] and padded[1][0] is c and padded[1][1] is None
    assert padded[2] == [None, None]
    assert pad_plan([[], []], 0) == [None]  # every rank runs at least one forward


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=12), st.integers(1, 5), st.integers(0, 10_000))
def test_every_row_once_in_order_and_groups_whole(sizes, world, seed):
    gen = torch.Generator().manual_seed(seed)
    group = torch.tensor([g for g, size in enumerate(sizes) for _ in range(size)])
    cost = torch.randint(0, 9, (len(group),), generator=gen)
    shares = split_rows(torch.arange(len(group)), group, cost, world)
    assert len(shares) == world
    assert torch.cat(shares).tolist() == list(range(len(group)))  # rank order = batch order, no row lost
    owners = {}
    for rank, share in enumerate(shares):
        for g in group[share].tolist():
            assert owners.setdefault(g, rank) == rank  # a group never spans two ranks
