"""EngineBackend: asyncrl's own engine (``asyncrl.engine.LLM``) behind the rollout protocol.

Prompts are fanned out by the engine itself (``params.n`` samples share the prompt's KV),
every token is tagged with the engine's weight version, and ``update_weights`` copies
HF-named tensors into the engine in place between steps.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from asyncrl.engine import LLM
from asyncrl.types import RequestOutput, SamplingParams


class EngineBackend:
    """Invariant: ``self.version == self.llm.version``: the version every new token gets."""

    # update_weights may run while generate runs in another thread: the engine swaps weights
    # between two steps; running sequences keep or recompute their KV (async: partial rollout)
    inflight_weight_update = True
    # generate may be called from several threads at once (the async weight sync's probe beside the
    # rollout): each call returns when its own requests end (LLM.generate)
    concurrent_generate = True

    def __init__(self, model, tokenizer=None, version: int = 0, dtype: Optional[torch.dtype] = None,
                 device: Optional[str] = None, kv_on_update: str = "keep", **engine_kwargs):
        """``model``: checkpoint dir or in-memory HF ``*ForCausalLM`` (weights copied).
        ``kv_on_update``: "keep" | "recompute", the K/V of running requests on a weight update
        (``runtime.partial_rollout_kv``; ``LLM.update_weights``)."""
        self.llm = LLM(model, tokenizer=tokenizer, version=version, dtype=dtype, device=device, **engine_kwargs)
        self.kv_on_update = kv_on_update

    @property
    def merged_lora(self) -> bool:
        """Serves a LoRA adapter merged into its weights: pushes send merged weights, not A and B."""
        return self.llm.merged_lora

    @property
    def adapter_dtype(self) -> Optional[torch.dtype]:
        """The dtype the engine holds an unmerged adapter in (None: no adapter slots)."""
        return self.llm.adapter_dtype

    @property
    def version(self) -> int:
        return self.llm.version

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        return self.llm.generate(prompt_token_ids, params)

    @property
    def last_update_timing(self) -> tuple[float, float]:
        """(seconds waiting for the engine's step in flight, seconds loading) of the last update."""
        return self.llm.last_update_timing

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.llm.update_weights(named_tensors, version, kv=self.kv_on_update)

    @property
    def metrics(self) -> dict:
        return self.llm.metrics
