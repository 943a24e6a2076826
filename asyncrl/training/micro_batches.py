"""Micro-batches balanced by tokens, with each prompt's group kept whole.

Splitting a mini-batch into micro-batches of ``micro_batch_size`` rows in order gives them very
different token counts when response lengths vary (GRPO: a group of long failures beside one of
short answers), and the slowest micro-batch sets the time and the peak memory. Here the number
of micro-batches stays ceil(B / micro_batch_size), but groups (rows of one prompt: their prompt
is computed once only when they share a micro-batch) are assigned largest first to the least
loaded micro-batch, by tokens (the prompt once + the responses), as verl's and OpenRLHF's
dynamic batching balance sequence lengths. The loss is unchanged: every micro-batch's loss is
normalised by the mini-batch's global counts (actor.py), so any split sums to the same total.
"""
from __future__ import annotations

import torch


def balanced_micro_batches(attention_mask: torch.Tensor, prompt_length: int, group_ids, micro_batch_size: int
                           ) -> list[torch.Tensor]:
    """Row indices of each micro-batch (ascending within one), for a batch [B, P + L]."""
    size = attention_mask.shape[0]
    count = -(-size // micro_batch_size)
    if count <= 1:
        return [torch.arange(size)]
    groups = group_ids.tolist() if group_ids is not None else list(range(size))
    lengths = attention_mask.sum(-1).tolist()
    prompts = attention_mask[:, :prompt_length].sum(-1).tolist()
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    cost = {g: prompts[rows[0]] + sum(lengths[r] - prompts[r] for r in rows) for g, rows in members.items()}
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for group in sorted(members, key=lambda g: (-cost[g], members[g][0])):
        target = load.index(min(load))
        bins[target].extend(members[group])
        load[target] += cost[group]
    return [torch.tensor(sorted(rows)) for rows in bins if rows]
