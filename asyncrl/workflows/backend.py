"""WorkflowBackend: a rollout backend whose sample is a whole episode of a workflow.

    async def rollout(client, example) -> Trajectory | float

For each example the backend runs ``rollout.n`` episodes concurrently (up to
``workflow.max_concurrent`` in all), each with its own :class:`PolicyClient` (its own session);
every turn of every episode joins the same continuous batch of the engine. Each episode
becomes one completion of the example's group (its tokens after the group's shared prompt,
the loss mask, log-probs and versions, its reward), so the sync and async controllers,
staleness bound, partial rollout and GRPO/PPO losses apply unchanged.

Advantages are trajectory-level: the episode's reward is the sequence score, normalised
within the example's group (GRPO) and given to every sampled token of every turn; inserted
tokens (tool results, template glue) carry no loss (docs/workflows.md).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable, Optional

from asyncrl.types import Example, RequestOutput, SamplingParams
from asyncrl.workflows.client import ContextLengthExceeded, PolicyClient
from asyncrl.workflows.generators import EngineGenerator, HTTPGenerator, turn_params
from asyncrl.workflows.trajectory import Trajectory, common_prefix_length

SEED_STRIDE = 7919  # episode e of a call samples with seed + e·stride (turn t: then ·1009 + t)


class WorkflowBackend:
    """Invariant: ``version`` and ``update_weights`` are the wrapped backend's; every episode
    of one ``generate_examples`` call is finished (or truncated) when it returns."""

    inflight_weight_update = True

    def __init__(self, base, rollout_fn: Callable, tokenizer, tools: Optional[dict] = None, tool_parser=None,
                 max_total_tokens: int = 1024, max_concurrent: int = 256, template_kwargs: Optional[dict] = None):
        self.base, self.fn, self.tokenizer = base, rollout_fn, tokenizer
        self.tools, self.tool_parser = tools or {}, tool_parser
        self.max_total_tokens, self.max_concurrent = max_total_tokens, max_concurrent
        self.template_kwargs = template_kwargs
        self._engine = None  # AsyncEngine over an in-process engine, started on first use

    @property
    def version(self) -> int:
        return self.base.version

    def update_weights(self, named_tensors, version: int) -> None:
        self.base.update_weights(named_tensors, version)

    @property
    def merged_lora(self) -> bool:
        """The wrapped backend's (a LoRA push sends it merged weights or A and B: weight_sync.rollout_weights)."""
        return getattr(self.base, "merged_lora", False)

    @property
    def adapter_dtype(self):
        """The wrapped backend's (the dtype a LoRA push casts A and B to: weight_sync.rollout_weights)."""
        return getattr(self.base, "adapter_dtype", None)

    @property
    def metrics(self) -> dict:
        return getattr(self.base, "metrics", {})

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        getattr(self.base, "close", lambda: None)()

    # ---- generation ------------------------------------------------------------------------
    def _engine_started(self):
        """The AsyncEngine over the wrapped backend's in-process engine (one thread steps it)."""
        if self._engine is None:
            from asyncrl.serve.async_engine import AsyncEngine
            self._engine = AsyncEngine(self.base.llm).start()
        return self._engine

    def _generator(self):
        """Turns go to the in-process engine or over HTTP."""
        if hasattr(self.base, "llm"):
            return EngineGenerator(self._engine_started())
        if hasattr(self.base, "async_client"):
            return HTTPGenerator(self.base.async_client(), self.base.model, version=self.base.version)
        raise ValueError(f"workflows need rollout.backend=engine or openai, not {type(self.base).__name__}")

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        """Single-turn generation on the same engine (no workflow)."""
        async def run():
            gen = self._generator()
            try:
                outs = await asyncio.gather(*(
                    gen.generate(ids, turn_params(params, params.max_tokens, _seed(params, i)),
                                 f"single-{uuid.uuid4().hex[:8]}")
                    for i, ids in enumerate(prompt_token_ids) for _ in range(params.n)))
            finally:
                await _close(gen)
            return [RequestOutput(list(ids), None, outs[i * params.n:(i + 1) * params.n])
                    for i, ids in enumerate(prompt_token_ids)]
        return asyncio.run(run())

    def generate_examples(self, examples: list[Example], params: SamplingParams) -> list[RequestOutput]:
        """``params.n`` episodes per example; one ``RequestOutput`` per example, in order."""
        return asyncio.run(self._run(examples, params))

    async def _run(self, examples: list[Example], params: SamplingParams) -> list[RequestOutput]:
        generator, gate = self._generator(), asyncio.Semaphore(self.max_concurrent)

        async def episode(example: Example, index: int) -> Trajectory:
            async with gate:
                return await self._episode(generator, example, params, index)
        try:
            trajectories = await asyncio.gather(*(episode(ex, i * params.n + j) for i, ex in enumerate(examples)
                                                  for j in range(params.n)))
        finally:
            await _close(generator)
        return [self._group(ex, trajectories[i * params.n:(i + 1) * params.n]) for i, ex in enumerate(examples)]

    async def _episode(self, generator, example: Example, params: SamplingParams, index: int) -> Trajectory:
        session = f"{example.uid or 'ep'}-{index}-{uuid.uuid4().hex[:8]}"
        client = PolicyClient(generator, self.tokenizer, params, session, self.tool_parser, self.max_total_tokens,
                              self.template_kwargs, _seed(params, index), _eos_ids(self))
        client.tools = self.tools
        try:
            result: Any = await self.fn(client, example)
        except ContextLengthExceeded:
            return client.trajectory(reward=0.0, truncated=1)
        if isinstance(result, Trajectory):
            if result.reward is None:
                raise ValueError("the workflow returned a Trajectory without a reward")
            return result
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return client.trajectory(reward=float(result))
        raise TypeError(f"a workflow returns a Trajectory or a float reward, got {type(result).__name__}")

    def _group(self, example: Example, trajectories: list[Trajectory]) -> RequestOutput:
        """The group's shared prompt (the episodes' common prefix) and one completion each."""
        cut = common_prefix_length([t.prompt_ids for t in trajectories])
        if cut == 0:
            raise ValueError("the episodes of one example share no prompt token; GRPO groups need a common prompt")
        prompt = trajectories[0].prompt_ids[:cut]
        return RequestOutput(prompt, example.prompt, [t.to_completion(self.tokenizer, cut) for t in trajectories])


async def _close(generator) -> None:
    """An HTTP generator's client (its connection pool belongs to this call's event loop)."""
    client = getattr(generator, "client", None)
    if client is not None:
        await client.close()


def _seed(params: SamplingParams, index: int) -> Optional[int]:
    return None if params.seed is None else params.seed + SEED_STRIDE * index


def _eos_ids(backend: WorkflowBackend) -> list[int]:
    llm = getattr(backend.base, "llm", None)
    ids = list(getattr(llm, "eos_token_ids", []) or [])
    return ids or [backend.tokenizer.eos_token_id]
