"""A role's view of the scored batch under data parallelism: this rank's micro-batches of
whole groups (split.py), padding micro-batches where another rank has more, and per-row
results gathered back to the whole batch on every rank.

With :data:`~asyncrl.distributed.group.SINGLE` this is exactly the one-process loop:
``torch.arange(B).split(micro_size)`` and a concatenation.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

import torch

from asyncrl.distributed.group import DataParallel
from asyncrl.distributed.split import micro_plan, split_rows
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


def micro_batches(batch: TrainBatch, dp: DataParallel, micro_size: int) -> Iterator[tuple[TrainBatch, int]]:
    """(micro-batch, real rows) of this rank's share of ``batch``; padding micro-batches
    (to the busiest rank's count) come last with 0 real rows."""
    shares = rank_shares(batch, torch.arange(batch.batch_size), dp)
    for index in micro_plan(shares, dp.rank, micro_size):
        if index is None:
            yield padding_row(batch), 0
        else:
            yield batch.select(index), len(index)


def map_rows(batch: TrainBatch, dp: DataParallel, micro_size: int,
             fn: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
    """``fn`` [b, ...] per row over this rank's micro-batches, gathered to [B, ...] in batch
    order on every rank (padding micro-batches run, their rows are dropped)."""
    shares = rank_shares(batch, torch.arange(batch.batch_size), dp)
    parts = []
    for index in micro_plan(shares, dp.rank, micro_size):
        out = fn(padding_row(batch) if index is None else batch.select(index))
        if index is not None:
            parts.append(out)
    # a rank with no rows ran padding only (micro_plan gives every rank >= 1 forward): it
    # joins the gather with an empty block of the right shape
    local = torch.cat(parts) if parts else out[:0]
    return dp.gather_rows(local, shares, batch.batch_size)
