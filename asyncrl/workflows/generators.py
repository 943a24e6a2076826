"""Where a turn's tokens come from: one sample for a token-id prompt, with log-probs and
versions. ``PolicyClient`` talks to one of these, so the same workflow runs on the in-process
engine or on any OpenAI-compatible server (asyncrl serve, vLLM, SGLang).

Both send *token ids*: an episode's context is never re-tokenized from text.
"""
from __future__ import annotations

import itertools
from typing import Optional, Protocol

from asyncrl.types import Completion, SamplingParams


class TurnGenerator(Protocol):
    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str) -> Completion:
        """One completion (``params.n`` is 1) of ``prompt_ids``."""
        ...


class EngineGenerator:
    """Turns on the in-process engine through an :class:`~asyncrl.serve.AsyncEngine`: every
    episode's turn joins the same continuous batch; the session id prefixes the request id."""

    def __init__(self, engine):
        self.engine = engine
        self._turns = itertools.count()

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str) -> Completion:
        out = await self.engine.generate(prompt_ids, params, request_id=f"{session_id}/{next(self._turns)}")
        return out.completions[0]


class HTTPGenerator:
    """Turns through ``POST /v1/completions`` of an OpenAI-compatible server, with token-id
    prompts and ``return_token_ids`` (asyncrl serve; vLLM >= 0.10.2 returns ``token_ids`` too).
    Servers that return no versions get ``version`` (the last one pushed to them)."""

    def __init__(self, client, model: str, version: int = 0):
        self.client, self.model, self.version = client, model, version  # client: openai.AsyncOpenAI

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str) -> Completion:
        from asyncrl.rollout.openai_backend import completion_from_choice, request_body

        out = await self.client.completions.create(**request_body(self.model, prompt_ids, params, session_id))
        return completion_from_choice(out.choices[0], self.version)


def turn_params(params: SamplingParams, max_tokens: int, seed: Optional[int]) -> SamplingParams:
    return SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          max_tokens=max_tokens, seed=seed, stop=list(params.stop),
                          stop_token_ids=list(params.stop_token_ids), ignore_eos=False, logprobs=True)
