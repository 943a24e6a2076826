"""Request bodies of the OpenAI-compatible API, validated by pydantic (FastAPI's own models).

Field names and defaults follow the OpenAI API; asyncrl extensions (the same names as vLLM
where vLLM has one) are:

* ``top_k``, ``ignore_eos``, ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``);
* ``return_token_ids`` — the response carries ``prompt_token_ids`` and, per choice,
  ``token_ids`` (what was sampled, never re-tokenized) and ``token_versions`` (the policy
  version of each token);
* ``session_id`` (or the ``X-Session-Id`` header) — the key a router uses to keep the turns
  of one multi-turn episode on one engine replica (its prefix cache holds the conversation).

Unknown fields are ignored (as vLLM does), so clients that send newer OpenAI fields work.
Requests asking for what the engine cannot do (``logit_bias``, penalties, ``top_logprobs``,
``echo``) are refused with a 400 that names the field, never silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

SESSION_HEADER = "x-session-id"


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    session_id: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    @model_validator(mode="after")
    def _supported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported (they change the sampled "
                             "distribution, and RL log-probs must be the sampled ones)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=1, description="asyncrl returns the sampled token's "
                                                                    "logprob; 0 or 1 alternatives")
    echo: bool = False
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=0, description="only the sampled token's logprob")
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    parallel_tool_calls: Optional[bool] = None

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.tool_choice not in (None, "auto", "none"):
            raise ValueError("tool_choice: only 'auto' and 'none' are supported (no constrained decoding)")
        return self

    @property
    def completion_budget(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def active_tools(self) -> Optional[list[dict[str, Any]]]:
        return None if self.tool_choice == "none" else self.tools


class UpdateWeightsRequest(BaseModel):
    """``POST /v1/update_weights`` with a JSON body: load a checkpoint directory or a
    ``.safetensors`` file from this host's disk (SGLang's ``/update_weights_from_disk`` shape)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    version: int = Field(..., ge=0)
    kv: Literal["keep", "recompute"] = "keep"
