"""Per-group statistics for outcome estimators (GRPO, RLOO, OPO, ...).

A group is the set of responses to one prompt: rows with equal ``group_ids``. All
functions take ``x [B]`` and ``group_ids [B]`` (any integer labels, any order) and
return per-row tensors ``[B]``, so each row sees its own group's statistic.
"""
from __future__ import annotations

import torch
from torch import Tensor


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index ``[B]`` in ``0..G-1`` and the number of groups ``G``."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_sum(x: Tensor, group_ids: Tensor) -> Tensor:
    """Σ_{j in group(i)} x_j, per row."""
    inverse, n_groups = group_index(group_ids)
    sums = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
    return sums[inverse]


def group_size(group_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Number of rows in group(i), per row."""
    return group_sum(torch.ones(group_ids.shape, dtype=dtype, device=group_ids.device), group_ids)


def group_mean(x: Tensor, group_ids: Tensor) -> Tensor:
    """Mean of x over group(i), per row."""
    return group_sum(x, group_ids) / group_size(group_ids, x.dtype)


def group_std(x: Tensor, group_ids: Tensor, unbiased: bool = True) -> Tensor:
    """Std of x over group(i), per row; Bessel-corrected (n−1) by default, like
    ``torch.std`` in verl and ``nanstd`` in TRL. Singleton groups give 0."""
    n = group_size(group_ids, x.dtype)
    sq = group_sum((x - group_mean(x, group_ids)) ** 2, group_ids)
    denom = (n - 1) if unbiased else n
    return torch.where(n > 1, sq / denom.clamp(min=1), torch.zeros_like(sq)).sqrt()
