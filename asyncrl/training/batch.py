"""Turning rollout outputs (or demonstrations) into a padded :class:`~asyncrl.types.TrainBatch`."""
from __future__ import annotations

from typing import Optional

import torch

from asyncrl.training.routing_replay import routes_from_completions
from asyncrl.types import RequestOutput, TrainBatch


def pad_prompt_response(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Left-pad prompts to P and right-pad responses to L.

    Returns input_ids [B, P+L], attention_mask [B, P+L], response_mask [B, L], P.
    Rows are padded as Python lists and converted once (one tensor per output, not per row:
    this runs on the trainer's critical path every step).
    """
    prompt_len = max(len(p) for p in prompts)
    resp_len = max(1, max(len(r) for r in responses))
    ids, attn, resp = [], [], []
    for prompt, response in zip(prompts, responses):
        left, right = prompt_len - len(prompt), resp_len - len(response)
        ids.append([pad_id] * left + list(prompt) + list(response) + [pad_id] * right)
        attn.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        resp.append([1.0] * len(response) + [0.0] * right)
    return (torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
            torch.tensor(resp, dtype=torch.float32), prompt_len)


def _pad_rows(rows: list[Optional[list]], length: int, fill, dtype) -> torch.Tensor:
    return torch.tensor([list(row or [])[:length] + [fill] * (length - len(row or [])) for row in rows], dtype=dtype)


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
    routing = routes_from_completions([(len(p), getattr(c, "routed_experts", None)) for p, c, _ in rows],
                                      prompt_len, length)
    if any(c.loss_mask is not None for _, c, _ in rows):  # multi-turn: tool tokens attend but carry no loss
        response_mask = _pad_rows([c.loss_mask if c.loss_mask is not None else [1] * len(c.token_ids)
                                   for _, c, _ in rows], length, 0, torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        prompt_length=prompt_len,
        rollout_logprobs=_pad_rows([c.logprobs for _, c, _ in rows], length, 0.0, torch.float32),
        token_versions=_pad_rows([c.versions for _, c, _ in rows], length, -1, torch.long),
        scores=torch.tensor(scores, dtype=torch.float32),
        group_ids=torch.tensor([g for _, _, g in rows], dtype=torch.long),
        routed_experts=routing[0] if routing else None, routing_mask=routing[1] if routing else None)
