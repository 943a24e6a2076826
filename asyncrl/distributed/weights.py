"""The sharded trainer's weights as a stream of full tensors, for the rollout backend.

``full_tensors(root, ...)`` yields ``(hf_name, tensor)`` for every parameter. Under FSDP2 it
gathers whole units (a decoder layer, the root's embedding/norm/head) with ``unshard()``: one
all-gather per unit, already in the compute dtype, grouped into buckets of about
``bucket_bytes``; the tensors of a bucket are yielded, then the bucket is resharded before the
next is gathered, so the extra memory is one bucket.

Invariant (the deadlock TRL hit with >2 ranks, SCALE.md §1.2): every rank iterates the whole
stream, in the same unit order, from the same thread; a rank with no consumer (all but rank 0)
drains it with :func:`drain`. Nothing else runs a collective between two gathers.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from asyncrl.distributed.fsdp import fsdp_units, is_sharded


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _own_parameters(unit: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name under ``unit``, parameter) of the parameters ``unit`` manages itself (not those of a
    nested FSDP unit), as they are now: full tensors after ``unshard()``."""
    nested = [name for name, m in unit.named_modules() if m is not unit and is_sharded(m)]
    return [(name, p) for name, p in unit.named_parameters()
            if not any(name.startswith(prefix + ".") for prefix in nested)]


def _unit_bytes(unit: torch.nn.Module, dtype: Optional[torch.dtype]) -> int:
    return sum(p.numel() * (dtype or p.dtype).itemsize for _, p in _own_parameters(unit))


def full_tensors(root: torch.nn.Module, bucket_bytes: int, prefix: str = "",
                 dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``root`` as (name without ``prefix``, full detached tensor in
    ``dtype``, default its own). Collective under FSDP2 (see module doc); a plain module's
    parameters are yielded as they are (no copy when the dtype matches)."""
    if not is_sharded(root):
        for name, param in root.named_parameters():
            yield _strip(name, prefix), param.detach().to(dtype or param.dtype)
        return
    names = {id(m): name for name, m in root.named_modules()}
    for bucket in _buckets(fsdp_units(root), bucket_bytes, dtype):
        for unit in bucket:
            unit.unshard()
        for unit in bucket:
            base = names[id(unit)]
            for name, param in _own_parameters(unit):
                full_name = f"{base}.{name}" if base else name
                yield _strip(full_name, prefix), param.detach().to(dtype or param.dtype)
        for unit in bucket:
            unit.reshard()


def _buckets(units: list, bucket_bytes: int, dtype: Optional[torch.dtype]) -> Iterator[list]:
    bucket, size = [], 0
    for unit in units:
        bucket.append(unit)
        size += _unit_bytes(unit, dtype)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def drain(stream: Iterator) -> int:
    """Run the rest of ``stream`` (its collectives) without keeping anything; returns the count."""
    count = 0
    for _ in stream:
        count += 1
    return count
