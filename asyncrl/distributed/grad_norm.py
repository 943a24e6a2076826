"""Gradient clipping over sharded gradients.

``torch.nn.utils.clip_grad_norm_`` reduces DTensor gradients itself, but not ones whose shards
live on the CPU under an NCCL mesh (FSDP2's CPU offload: verl's ``fsdp2_clip_grad_norm_``
exists for the same reason). Here each rank sums the squares of its own shard (every element
of a ``Shard(0)`` parameter lives on exactly one rank), one all-reduce adds the ranks' sums,
and every rank scales its shard by the same coefficient: the global norm and the same rule
as torch's, ``coef = min(1, max_norm / (norm + 1e-6))``.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from asyncrl.distributed.group import DataParallel


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, dp: DataParallel) -> torch.Tensor:
    """Scale the gradients of ``params`` in place to a global L2 norm of at most ``max_norm``;
    returns the norm before clipping (a 0-d float64 CPU tensor, equal on every rank; inf/nan
    when a gradient is not finite)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    square_sum = torch.zeros((), dtype=torch.float64, device=dp.comm_device)
    for grad in grads:  # per-tensor norms, their squares summed in fp64 (no fp64 copy of a gradient)
        square_sum += torch.linalg.vector_norm(grad).double().pow(2).to(square_sum.device)
    norm = dp.all_reduce_sum_(square_sum).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return norm.cpu()
