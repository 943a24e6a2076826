"""Whole tensors from FSDP2 shards with ONE all-gather for many small tensors.

``DTensor.full_tensor()`` is one collective per tensor: for a LoRA push (two small tensors per
adapted linear, ~500 for Qwen3-8B at seven linears) its latency, not its bytes, is the cost
(~2 ms per call on CPU gloo). :func:`gather_whole` packs every rank's shards into one flat
buffer, gathers it once, and cuts the whole tensors back out.

Layout: FSDP2 shards each parameter on dim 0 the way ``torch.chunk`` does (``Shard(0)``): rank r
holds rows ``[r·c, min((r+1)·c, d0))`` with ``c = ceil(d0 / world)`` (empty for the last ranks
when d0 < world·c). Each rank pads its rows of every tensor to ``c`` so that the buffers have
the same size on every rank. The buffer travels on the mesh's device (FSDP2's CPU offload keeps
shards in host memory; NCCL gathers CUDA tensors), in the widest dtype of the tensors (bf16 ->
fp32 -> bf16 is exact).

Invariant: every rank calls it with the same tensors in the same order (a collective).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _is_dim0_shard(tensor: torch.Tensor) -> bool:
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.dim() > 0
            and tensor.placements == (Shard(0),))


def gather_whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole value of each tensor, in its own dtype: dim-0 ``DTensor`` shards (FSDP2's)
    through one all-gather; another DTensor by its own ``full_tensor()``; a plain tensor as is.
    Whole tensors come back on the mesh's device (the CPU under gloo)."""
    sharded = [t for t in tensors if _is_dim0_shard(t)]
    gathered = iter(_gather_dim0(sharded) if sharded else [])
    return [next(gathered) if _is_dim0_shard(t) else t.full_tensor() if isinstance(t, DTensor) else t
            for t in tensors]


def _gather_dim0(tensors: list[DTensor]) -> list[torch.Tensor]:
    mesh = tensors[0].device_mesh
    world, group = mesh.size(), mesh.get_group()
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    rows = [math.ceil(t.shape[0] / world) for t in tensors]
    pieces = []
    for tensor, chunk in zip(tensors, rows):
        local = tensor.to_local().to(device, dtype)
        padding = chunk - local.shape[0]
        pieces.append(local.reshape(-1))
        if padding:
            pieces.append(local.new_zeros(padding * math.prod(tensor.shape[1:])))
    buffer = torch.cat(pieces)
    out = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(out, buffer, group=group)
    return [_cut(out, tensors, rows, i, world) for i in range(len(tensors))]


def _cut(out: list[torch.Tensor], tensors: list[DTensor], rows: list[int], index: int, world: int) -> torch.Tensor:
    """Tensor ``index``'s whole value from every rank's gathered buffer."""
    tensor, chunk = tensors[index], rows[index]
    inner = math.prod(tensor.shape[1:])
    offset = sum(c * math.prod(t.shape[1:]) for t, c in zip(tensors[:index], rows[:index]))
    parts = []
    for rank in range(world):
        valid = max(0, min(chunk, tensor.shape[0] - rank * chunk))
        parts.append(out[rank][offset:offset + valid * inner].view(valid, *tensor.shape[1:]))
    return torch.cat(parts).to(tensor.dtype)
