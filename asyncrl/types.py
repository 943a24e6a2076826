"""Records that cross module boundaries.

Everything here is plain data (dataclasses of Python lists / tensors) so that the
engine, the rollout backends, the reward pool and the trainer can exchange it
without importing each other. Nothing in this module imports the rest of asyncrl.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class SamplingParams:
    """How to sample completions, shaped like vLLM's ``SamplingParams``.

    ``logprobs=True`` asks for the log-probability of every sampled token under the
    distribution actually sampled from (after temperature, top-k and top-p), which is
    what an RL trainer needs as the behaviour policy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation
    max_tokens: int = 16
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    Invariant: ``len(token_ids) == len(logprobs) == len(versions)`` (logprobs may be
    None when not requested). ``versions[t]`` is the policy version whose weights
    produced token t.
    """

    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]]
    finish_reason: str  # "stop" (EOS / stop string), "length" (max_tokens), "abort"
    versions: list[int] = field(default_factory=list)
    # MoE routing replay: expert ids [P + len(token_ids) - 1, L_moe, K] int16 of every token that
    # went through the engine's forward (prompt, then completion but its last token), or None
    routed_experts: Optional[Any] = None
    # Multi-turn trajectories (asyncrl.workflows): ``token_ids`` holds every token after the
    # first prompt, the policy's and the tools'/environment's; ``loss_mask[t]`` is 1 on tokens
    # the policy sampled and 0 on the others (their logprob is 0, their version −1).
    # None: every token was sampled (single turn).
    loss_mask: Optional[list[int]] = None
    reward: Optional[float] = None  # set by a workflow: the episode's reward (no reward fn then)
    info: dict[str, Any] = field(default_factory=dict)  # workflow counters (turns, tool_calls ...)


#: vLLM's name for one sampled continuation.
CompletionOutput = Completion


@dataclass
class RequestOutput:
    """The n completions of one prompt, shaped like vLLM's: ``outputs[i].text``,
    ``.token_ids``, ``.logprobs``, ``.finish_reason``. ``completions`` is the same list."""

    prompt_token_ids: list[int]
    prompt: Optional[str]
    outputs: list[Completion]

    @property
    def completions(self) -> list[Completion]:
        """Alias of ``outputs`` (asyncrl's earlier name)."""
        return self.outputs

    @completions.setter
    def completions(self, value: list[Completion]) -> None:
        self.outputs = value


@dataclass
class Example:
    """One task instance: a prompt, its reference answer and extra fields.

    ``fields`` is passed to reward functions as keyword arguments.
    """

    prompt: str
    answer: str
    fields: dict[str, Any] = field(default_factory=dict)
    uid: str = ""


@dataclass
class TrainBatch:
    """A padded batch of B responses ready for the trainer.

    Shapes (B responses, P = padded prompt length, L = padded response length):
      input_ids       [B, P + L]  left-padded prompt, right-padded response
      attention_mask  [B, P + L]  1 on real tokens
      response_mask   [B, L]      1 on response tokens that count in the loss
      rollout_logprobs[B, L]      behaviour log-probs from the rollout backend (0 on pad)
      token_versions  [B, L]      policy version of each response token (-1 on pad)
      scores          [B]         scalar reward per response
      group_ids       [B]         responses with equal id share a prompt (GRPO groups)
      routed_experts  [B, P + L, L_moe, K] int16, routing_mask [B, P + L] bool: the rollout's
                      MoE expert ids per token (MoE engine rollouts only; routing replay)
    Filled by the trainer's stages: old_logprobs, ref_logprobs, values, advantages,
    returns (all [B, L]).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    rollout_logprobs: torch.Tensor
    token_versions: torch.Tensor
    scores: torch.Tensor
    group_ids: torch.Tensor
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    routing_mask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    def select(self, index: torch.Tensor) -> "TrainBatch":
        """Rows ``index`` of every tensor field (for mini/micro-batching and filtering)."""
        kwargs = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            kwargs[name] = value[index] if isinstance(value, torch.Tensor) else value
        return TrainBatch(**kwargs)
