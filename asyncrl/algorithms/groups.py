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


def group_min(x: Tensor, group_ids: Tensor) -> Tensor:
    """Min of x over group(i), per row."""
    inverse, n_groups = group_index(group_ids)
    init = torch.full((n_groups,), float("inf"), dtype=x.dtype, device=x.device)
    return init.scatter_reduce(0, inverse, x, reduce="amin")[inverse]


def group_mean(x: Tensor, group_ids: Tensor) -> Tensor:
    """Mean of x over group(i), per row, computed as min + mean(x − min).

    Why the shift: a plain Σx/n of n equal float32 values can miss x by an ulp, and
    GRPO then divides that ulp by (σ ≈ 0) + 1e-6, giving all-correct groups spurious
    advantages up to ~0.2. Shifted by the group min, a constant group sums exact zeros,
    so its mean is exactly its value and its advantage exactly 0.
    """
    shift = group_min(x, group_ids)
    return shift + group_sum(x - shift, group_ids) / group_size(group_ids, x.dtype)


def group_std(x: Tensor, group_ids: Tensor, unbiased: bool = True) -> Tensor:
    """Std of x over group(i), per row; Bessel-corrected (n−1) by default, like
    ``torch.std`` in verl and ``nanstd`` in TRL. Singleton groups give 0."""
    n = group_size(group_ids, x.dtype)
    sq = group_sum((x - group_mean(x, group_ids)) ** 2, group_ids)
    denom = (n - 1) if unbiased else n
    return torch.where(n > 1, sq / denom.clamp(min=1), torch.zeros_like(sq)).sqrt()
