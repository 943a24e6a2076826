"""Which rows of a batch each rank computes: whole groups, balanced by tokens, and the same
number of micro-batches on every rank.

Every rank holds the whole scored batch (rank 0 broadcasts it), so each computes every rank's
share by the same deterministic rule and no collective is needed to agree on it.

Rules:
  * a GRPO group (equal ``group_ids``, contiguous: the batch is prompt-major) goes to one rank
    whole, so the rank runs its prompt once; a group cut by a mini-batch boundary is split
    there, as in one process;
  * groups are dealt out in order, contiguously, so that rank r's groups are those whose
    cumulative-cost midpoint falls in [r, r + 1) · total / world: an exact, uneven split when
    the world does not divide the batch (never a dropped row); a rank may get no row at all;
  * FSDP2 all-gathers weights inside every forward, so every rank must run the same number of
    forwards: a rank with fewer rows runs *padding* micro-batches (marked ``None``), a row with
    its loss mask zeroed, whose loss and gradient are exactly 0.
"""
from __future__ import annotations

from typing import Optional

import torch


def group_runs(group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal consecutive ids in ``group_ids`` [n]."""
    n = int(group_ids.numel())
    if n == 0:
        return []
    change = torch.nonzero(group_ids[1:] != group_ids[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), n]
    return list(zip(bounds[:-1], bounds[1:]))


def split_rows(rows: torch.Tensor, group_ids: torch.Tensor, cost: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Rows ``rows`` [n] (global indices, in batch order) dealt to ``world`` ranks in whole
    groups; ``group_ids`` / ``cost`` are per global row. Returns one index tensor per rank
    (possibly empty), whose concatenation in rank order is ``rows``."""
    if world == 1:
        return [rows]
    runs = group_runs(group_ids[rows])
    run_cost = torch.tensor([float(cost[rows[a:b]].sum()) for a, b in runs], dtype=torch.float64)
    total = float(run_cost.sum())
    if total <= 0:  # no cost information: count rows instead
        run_cost = torch.tensor([float(b - a) for a, b in runs], dtype=torch.float64)
        total = float(run_cost.sum())
    midpoints = run_cost.cumsum(0) - run_cost / 2
    owner = (midpoints / total * world).floor().clamp(max=world - 1).long().tolist()
    shares: list[list[int]] = [[] for _ in range(world)]
    for (a, b), rank in zip(runs, owner):
        shares[rank].extend(range(a, b))
    return [rows[torch.tensor(share, dtype=torch.long)] for share in shares]


def pad_plan(plans: list[list[torch.Tensor]], rank: int) -> list[Optional[torch.Tensor]]:
    """Rank ``rank``'s micro-batches (``plans``: every rank's, computed alike on every rank),
    padded with ``None`` to the largest rank's count (at least 1) so every rank runs the same
    number of forwards."""
    steps = max(1, max(len(plan) for plan in plans))
    return list(plans[rank]) + [None] * (steps - len(plans[rank]))
