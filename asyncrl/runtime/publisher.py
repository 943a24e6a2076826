"""Pushing the trainer's current weights into the rollout backend.

One process: the backend reads the actor's parameters as they are (``named_parameters``; HF
generate shares them, the engine copies them). FSDP2: the parameters are shards, so every rank
runs the bucketed full-tensor stream (distributed/weights.py) and rank 0, the only rank with a
backend, loads each tensor as it arrives; the other ranks drain the stream, gather for gather.
"""
from __future__ import annotations

from typing import Iterator

import torch

from asyncrl.distributed.group import SINGLE
from asyncrl.distributed.lockstep import replicated
from asyncrl.distributed.weights import drain, full_tensors
from asyncrl.runtime.weight_sync import rollout_weights

MIB = 1 << 20


class WeightPublisher:
    """Pushes the actor's weights to ``backend`` (None on ranks other than 0).

    Invariant: after ``push(v)`` returns on rank 0, the backend holds the actor's current
    weights and reports version v; every rank ran the same gathers."""

    def __init__(self, actor, backend, bucket_mb: int, dtype: torch.dtype):
        # no actor: a controller driven without a trainer (its tests); nothing is pushed then
        self.actor, self.backend, self.dp = actor, backend, actor.dp if actor is not None else SINGLE
        self.bucket_bytes, self.dtype = bucket_mb * MIB, dtype

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of the actor (collective under FSDP2: iterate on every rank)."""
        if not self.dp.sharded:
            return rollout_weights(self.actor.model, self.backend)  # LoRA: the adapters (or merged layers)
        return full_tensors(self.actor.forward_module, self.bucket_bytes, prefix="policy.", dtype=self.dtype)

    @replicated("weights")
    def push(self, version: int) -> None:
        stream = self.named_tensors()
        try:
            if self.backend is not None:
                self.backend.update_weights(stream, version)
        finally:
            if self.dp.sharded:
                drain(stream)  # what the backend did not read (all of it on ranks without one)
