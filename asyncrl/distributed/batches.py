"""A role's view of the scored batch under data parallelism: this rank's share of whole
groups (split.py), cut into micro-batches balanced by tokens (training/micro_batches.py),
padding micro-batches where another rank has more, and per-row results gathered back to the
whole batch on every rank.

With :data:`~asyncrl.distributed.group.SINGLE` this is exactly the one-process loop: the
balanced micro-batches of the whole batch, results placed at their rows.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

import torch

from asyncrl.distributed.group import DataParallel
from asyncrl.distributed.split import pad_plan, split_rows
from asyncrl.training.micro_batches import balanced_micro_batches
from asyncrl.types import TrainBatch


def rank_shares(batch: TrainBatch, rows: torch.Tensor, dp: DataParallel) -> list[torch.Tensor]:
    """Every rank's rows of ``rows`` (indices into ``batch``), whole groups, balanced by tokens."""
    cost = batch.attention_mask.sum(-1)
    return split_rows(rows, batch.group_ids, cost, dp.world_size)


def padding_row(batch: TrainBatch) -> TrainBatch:
    """One row of ``batch`` with nothing to learn from: its loss mask is zero, so its loss and
    gradient are exactly 0, while its forward runs the same collectives as a real one."""
    row = batch.select(torch.tensor([0]))
    return replace(row, response_mask=torch.zeros_like(row.response_mask))


def _rank_plan(batch: TrainBatch, dp: DataParallel, micro_size: int):
    """(every rank's rows in the order its micro-batches compute them, this rank's micro-batches
    padded with ``None`` to the busiest rank's count). Every rank computes every rank's plan
    alike, so each knows where the others' results belong."""
    shares = rank_shares(batch, torch.arange(batch.batch_size), dp)
    plans = [[share[part] for part in balanced_micro_batches(batch.attention_mask[share], batch.prompt_length,
                                                               batch.group_ids[share], micro_size)]
             if len(share) else [] for share in shares]
    orders = [torch.cat(plan) if plan else torch.zeros(0, dtype=torch.long) for plan in plans]
    return orders, pad_plan(plans, dp.rank)


def micro_batches(batch: TrainBatch, dp: DataParallel, micro_size: int) -> Iterator[tuple[TrainBatch, int]]:
    """(micro-batch, real rows) of this rank's share of ``batch``; padding micro-batches
    (to the busiest rank's count) come last with 0 real rows."""
    for index in _rank_plan(batch, dp, micro_size)[1]:
        if index is None:
            yield padding_row(batch), 0
        else:
            yield batch.select(index), len(index)


def map_rows(batch: TrainBatch, dp: DataParallel, micro_size: int,
             fn: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
    """``fn`` [b, ...] per row over this rank's micro-batches, gathered to [B, ...] in batch
    order on every rank (padding micro-batches run, their rows are dropped)."""
    orders, plan = _rank_plan(batch, dp, micro_size)
    parts = []
    for index in plan:
        out = fn(padding_row(batch) if index is None else batch.select(index))
        if index is not None:
            parts.append(out)
    # a rank with no rows ran padding only (the plan gives every rank >= 1 forward): it joins
    # the gather with an empty block of the right shape
    local = torch.cat(parts) if parts else out[:0]
    return dp.gather_rows(local, orders, batch.batch_size)
