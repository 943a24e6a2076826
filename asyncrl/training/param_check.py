"""The check after every optimizer step that the weights are still finite.

A NaN/Inf gradient is caught before the step (the step is skipped); this catches what gets
past that: a finite but absurd update (an infinite learning rate, an overflow inside the
optimizer). Stopping at the step that poisoned the weights, with the parameter named, keeps
every checkpoint written so far healthy (checkpoint.py also refuses to write NaN weights).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from asyncrl.errors import NonFiniteError


@torch.no_grad()
def check_parameters_finite(model: torch.nn.Module, where: str,
                            params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Raise :class:`NonFiniteError` naming the first non-finite parameter of ``model``.

    ``params``: the tensors to check when not all of ``model``'s (the ones the optimizer
    changes; a caller that checks every step keeps this list, as a walk of the module tree per
    step costs more than the check on a tiny model). One fused norm per tensor and one device
    sync per call (a NaN or Inf anywhere makes its tensor's norm non-finite); the
    per-parameter scan that names the culprit runs only on failure."""
    tensors = list(model.parameters() if params is None else params)  # no_grad: no detach needed
    if not tensors:
        return
    norms = torch._foreach_norm(tensors)
    if len({n.dtype for n in norms}) > 1:
        norms = [n.float() for n in norms]
    # one scalar: a NaN or Inf norm makes the sum non-finite (norms are >= 0, so no inf - inf); a norm
    # or sum that overflows from finite weights only sends the check to the exact per-parameter scan
    if math.isfinite(torch.stack(norms).sum().item()):
        return
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            bad = int((~torch.isfinite(param)).sum())
            raise NonFiniteError(f"parameter {name} holds {bad} NaN/Inf values after {where}; the weights are "
                                 "poisoned and were not saved")
