"""The frozen reference policy, for the KL term. Loaded only when a KL coefficient is set."""
from __future__ import annotations

import copy
from typing import Optional

import torch

from asyncrl.distributed.batches import map_rows
from asyncrl.distributed.group import SINGLE, DataParallel
from asyncrl.distributed.lockstep import replicated
from asyncrl.training.forward import PolicyLogprobs
from asyncrl.types import TrainBatch


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with no gradients (meta stays meta)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


class Reference:
    """A frozen copy of the initial policy. Invariant: its weights never change.

    ``forward``: the module to call (an FSDP2-sharded :class:`PolicyLogprobs` under ``dp``);
    by default a plain one around a frozen copy of ``model``."""

    def __init__(self, model, temperature: float, micro_batch_size: int, chunk_tokens: int, *,
                 forward: Optional[torch.nn.Module] = None, dp: DataParallel = SINGLE):
        self.forward_module = forward if forward is not None else PolicyLogprobs(frozen_copy(model))
        self.model = self.forward_module.policy
        self.dp = dp
        self.device = dp.device if dp.sharded else next(self.model.parameters()).device
        self.temperature, self.micro_batch_size, self.chunk_tokens = temperature, micro_batch_size, chunk_tokens

    @replicated("reference")
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        def forward(micro: TrainBatch) -> torch.Tensor:
            return self.forward_module(micro.input_ids.to(self.device), micro.attention_mask.to(self.device),
                                       micro.prompt_length, self.temperature, self.chunk_tokens)[0]

        logprobs = map_rows(batch, self.dp, self.micro_batch_size, forward)
        return logprobs.to(batch.response_mask.device) * batch.response_mask  # the batch's device
