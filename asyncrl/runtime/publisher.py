"""Pushing the trainer's current weights into the rollout backend.

One process: the backend reads the actor's parameters as they are (``named_parameters``; HF
generate shares them, the engine copies them). FSDP2: the parameters are shards, so every rank
runs the bucketed full-tensor stream (distributed/weights.py) and rank 0, the only rank with a
backend, loads each tensor as it arrives; the other ranks drain the stream, gather for gather.
A LoRA policy (PEFT) under FSDP2 streams its adapters only, each gathered whole and handed to
the engine in its dtype (or, with ``actor.lora.merged_rollout``, the adapted layers' merged
weights, one layer at a time): KBs-MBs; the base shards are never gathered for a push.
"""
from __future__ import annotations

from typing import Iterator

import torch

from asyncrl.config_schema import ConfigError
from asyncrl.distributed.group import SINGLE
from asyncrl.distributed.lockstep import replicated
from asyncrl.distributed.weights import drain, full_tensors
from asyncrl.runtime.weight_sync import rollout_weights
from asyncrl.training.lora import is_lora, iter_merged_tensors
from asyncrl.training.lora_sharded import full_adapter_tensors

MIB = 1 << 20


class WeightPublisher:
    """Pushes the actor's weights to ``backend`` (None on ranks other than 0).

    Invariant: after ``push(v)`` returns on rank 0, the backend holds the actor's current
    weights and reports version v; every rank ran the same gathers."""

    def __init__(self, actor, backend, bucket_mb: int, dtype: torch.dtype, merged_lora: bool = False):
        """``merged_lora`` (``actor.lora.merged_rollout``): a LoRA push sends merged weights; every
        rank must know it (only rank 0 has the backend that says so)."""
        # no actor: a controller driven without a trainer (its tests); nothing is pushed then
        self.actor, self.backend, self.dp = actor, backend, actor.dp if actor is not None else SINGLE
        self.bucket_bytes, self.dtype, self.merged_lora = bucket_mb * MIB, dtype, merged_lora
        self.last_bytes = 0  # of the last push, counted on rank 0 (weight_sync/bytes)
        if self.dp.sharded and backend is not None and getattr(backend, "merged_lora", False) != merged_lora:
            # the ranks' gather streams would differ (merged layers vs adapters): refuse before any
            raise ConfigError(f"actor.lora.merged_rollout={merged_lora} but the rollout backend "
                              f"{type(backend).__name__} {'serves' if not merged_lora else 'does not serve'} merged "
                              "LoRA weights; with trainer.strategy=fsdp2 use rollout.backend=engine")

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of the actor (collective under FSDP2: iterate on every rank)."""
        if not self.dp.sharded:
            return rollout_weights(self.actor.model, self.backend)  # LoRA: the adapters (or merged layers)
        if is_lora(self.actor.model):
            if self.merged_lora:
                return iter_merged_tensors(self.actor.model)
            # gathered in their own dtype (fp32: the gather of KBs-MBs costs nothing), then cast on
            # rank 0 to what its backend holds, as one process sends (runtime/weight_sync.py)
            dtype = getattr(self.backend, "adapter_dtype", None)
            return ((name, t.to(dtype or t.dtype)) for name, t in full_adapter_tensors(self.actor.model))
        return full_tensors(self.actor.forward_module, self.bucket_bytes, prefix="policy.", dtype=self.dtype)

    @replicated("weights")
    def push(self, version: int) -> None:
        tensors = self.named_tensors()
        stream = self._counted(tensors) if self.dp.sharded else tensors
        if not self.dp.sharded:  # a list: the backend gets it as one process always handed it
            self.last_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        try:
            if self.backend is not None:
                self.backend.update_weights(stream, version)
        finally:
            if self.dp.sharded:
                drain(stream)  # what the backend did not read (all of it on ranks without one)

    def _counted(self, stream) -> Iterator[tuple[str, torch.Tensor]]:
        self.last_bytes = 0
        for name, tensor in stream:
            self.last_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
