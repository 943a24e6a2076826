"""Turning rollout outputs (or demonstrations) into a padded :class:`~asyncrl.types.TrainBatch`."""
from __future__ import annotations

from typing import Optional

import torch

from asyncrl.types import RequestOutput, TrainBatch


def pad_prompt_response(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Left-pad prompts to P and right-pad responses to L.

    Returns input_ids [B, P+L], attention_mask [B, P+L], response_mask [B, L], P.
    """
    prompt_len = max(len(p) for p in prompts)
    resp_len = max(1, max(len(r) for r in responses))
    size = len(prompts)
    input_ids = torch.full((size, prompt_len + resp_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(size, resp_len)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        start, n = prompt_len - len(prompt), len(response)
        input_ids[i, start:prompt_len + n] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        attention_mask[i, start:prompt_len + n] = 1
        response_mask[i, :n] = 1
    return input_ids, attention_mask, response_mask, prompt_len


def _pad_rows(rows: list[Optional[list]], length: int, fill, dtype) -> torch.Tensor:
    out = torch.full((len(rows), length), fill, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def build_train_batch(outputs: list[RequestOutput], scores: list[float], pad_id: int,
                      group_offset: int = 0) -> TrainBatch:
    """One row per completion, prompt-major (all completions of prompt 0, then prompt 1 ...).

    ``scores`` holds one reward per completion in that order. Group ids are prompt
    indices plus ``group_offset``.
    """
    rows = [(out.prompt_token_ids, c, g + group_offset) for g, out in enumerate(outputs) for c in out.completions]
    if len(rows) != len(scores):
        raise ValueError(f"{len(scores)} scores for {len(rows)} completions")
    input_ids, attention_mask, response_mask, prompt_len = pad_prompt_response(
        [p for p, _, _ in rows], [c.token_ids for _, c, _ in rows], pad_id)
    length = response_mask.shape[1]
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        prompt_length=prompt_len,
        rollout_logprobs=_pad_rows([c.logprobs for _, c, _ in rows], length, 0.0, torch.float32),
        token_versions=_pad_rows([c.versions for _, c, _ in rows], length, -1, torch.long),
        scores=torch.tensor(scores, dtype=torch.float32),
        group_ids=torch.tensor([g for _, _, g in rows], dtype=torch.long))
