"""Masked statistics shared by the estimators and losses.

Shapes: ``x`` and ``mask`` broadcast to each other; ``mask`` is 1 on valid entries.
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask over ``dim`` (all dims if None)."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask; 0 where the mask is empty (not NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of ``x`` (Bessel-corrected by default, like verl).

    Fewer than two valid entries give 0, not NaN: whitening then maps them to 0.
    """
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = (n - 1) if unbiased else n
    return torch.where(n > 1, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over the valid entries of the whole tensor.

    Token-weighted: a long response contributes more entries to the mean and std than
    a short one (this is verl's REINFORCE++ / GAE whitening). Masked entries are not
    zeroed here; callers multiply by the mask.
    """
    # Whitening is shift-invariant; shifting by the smallest valid entry makes a constant
    # input whiten to exactly 0 (a plain float32 mean can miss it by an ulp, which
    # rsqrt(0 + 1e-8) = 1e4 would amplify).
    shift = torch.where(mask > 0, x, torch.full_like(x, float("inf"))).min()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # empty mask
    x0 = x - shift
    mean = masked_mean(x0, mask)
    var = masked_var(x0, mask, unbiased=True)
    whitened = (x0 - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean + shift


def last_token_index(mask: Tensor) -> Tensor:
    """[B, L] mask -> [B] index of each row's last valid token (0 for an empty row)."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask > 0) * positions).argmax(dim=-1)
