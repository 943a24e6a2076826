"""The frozen reference policy, for the KL term. Loaded only when a KL coefficient is set."""
from __future__ import annotations

import copy

import torch

from asyncrl.training.logprobs import response_logprobs
from asyncrl.types import TrainBatch


class Reference:
    """A frozen copy of the initial policy. Invariant: its weights never change."""

    def __init__(self, model, temperature: float, micro_batch_size: int, chunk_tokens: int):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.temperature, self.micro_batch_size, self.chunk_tokens = temperature, micro_batch_size, chunk_tokens

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        parts = []
        for idx in torch.arange(batch.batch_size).split(self.micro_batch_size):
            micro = batch.select(idx)
            lp, _ = response_logprobs(self.model, micro.input_ids.to(device), micro.attention_mask.to(device),
                                      micro.prompt_length, self.temperature, self.chunk_tokens)
            parts.append(lp)
        return torch.cat(parts).to(batch.response_mask.device) * batch.response_mask  # the batch's device
