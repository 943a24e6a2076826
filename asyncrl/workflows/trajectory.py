"""Trajectory: one episode's tokens exactly as they were sampled or inserted.

    prompt_ids | turn 1 (sampled) | tool result + next prompt (inserted) | turn 2 (sampled) | ...

Invariant: ``len(token_ids) == len(loss_mask) == len(logprobs) == len(versions)``; a token
with ``loss_mask`` 1 was sampled by the policy (``logprobs`` is its sampling log-prob,
``versions`` the policy version that sampled it), a token with 0 was inserted by the chat
template, a tool or the environment (log-prob 0, version −1: the trainer attends to it but
puts no loss on it; the staleness metrics skip it like padding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl.types import Completion


@dataclass
class Trajectory:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: Optional[float] = None
    finish_reason: str = "stop"   # of the last sampled turn
    info: dict[str, Any] = field(default_factory=dict)  # turns, tool_calls, anything the workflow adds

    def add_sampled(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)

    def add_inserted(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    @property
    def context(self) -> list[int]:
        """Everything the model has seen so far (the next turn's prompt)."""
        return self.prompt_ids + self.token_ids

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def to_completion(self, tokenizer, prompt_len: Optional[int] = None) -> Completion:
        """The trainer's view: a completion after the first ``prompt_len`` prompt tokens (the
        group's shared prompt; any rest of this episode's prompt becomes inserted tokens)."""
        cut = len(self.prompt_ids) if prompt_len is None else prompt_len
        extra = self.prompt_ids[cut:]
        ids = extra + self.token_ids
        return Completion(token_ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else "",
                          logprobs=[0.0] * len(extra) + self.logprobs, finish_reason=self.finish_reason,
                          versions=[-1] * len(extra) + self.versions, loss_mask=[0] * len(extra) + self.loss_mask,
                          reward=self.reward, info=dict(self.info))


def common_prefix_length(sequences: list[list[int]]) -> int:
    """Length of the longest prefix all ``sequences`` share."""
    if not sequences:
        return 0
    first, n = sequences[0], min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n
