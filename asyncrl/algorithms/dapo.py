"""DAPO's reward shaping and dynamic sampling (arXiv 2503.14476)."""
from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.groups import group_index


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> Tensor:
    """Soft length penalty ``[B]`` (≤ 0), added to the score:

        exceed = |o| − (L_max − L_buf);  penalty = min(−exceed / L_buf · f, 0)

    0 up to L_max − L_buf, then linear down to −f at L_max. Unlike verl we clamp at −f,
    so a length past L_max (impossible when generation is capped) is not punished more.
    """
    if buffer_length <= 0:
        raise ValueError("buffer_length must be > 0")
    # integer lengths compute in float64, as verl's Python-float arithmetic (the scores the
    # penalty is added to are Python floats too); a floating input keeps its own dtype
    dtype = response_lengths.dtype if response_lengths.is_floating_point() else torch.float64
    exceed = response_lengths.to(dtype) - (max_response_length - buffer_length)
    penalty = (-exceed / buffer_length * penalty_factor).clamp(max=0.0)
    return penalty.clamp(min=-abs(penalty_factor))


def filter_groups(metric: Tensor, group_ids: Tensor) -> Tensor:
    """Dynamic sampling keep mask ``[B]`` bool: keep a group if its metric varies
    (population std > 0) or it has a single member.

    Groups with a constant metric (all correct or all wrong) have zero GRPO advantage
    and only dilute the batch. "Varies" is tested as max > min, which is exactly
    std > 0 without the float round-off of computing a std.
    """
    inverse, n_groups = group_index(group_ids)
    values = metric.to(torch.float64)
    hi = torch.full((n_groups,), -float("inf"), dtype=values.dtype).scatter_reduce(
        0, inverse, values, reduce="amax"
    )
    lo = torch.full((n_groups,), float("inf"), dtype=values.dtype).scatter_reduce(
        0, inverse, values, reduce="amin"
    )
    size = torch.bincount(inverse, minlength=n_groups)
    keep_group = (hi > lo) | (size == 1)
    return keep_group[inverse]
