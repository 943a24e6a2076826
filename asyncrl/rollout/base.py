"""The rollout-backend protocol: the one interface the runtime uses to generate.

Backends: the asyncrl engine (``asyncrl.engine``), HF ``generate`` (the fallback,
``rollout/hf.py``), and remote OpenAI-compatible servers. The runtime never imports a
concrete backend; it asks ``rollout.registry.build_backend`` for one by config name.
"""
from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch

from asyncrl.types import RequestOutput, SamplingParams


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates completions with per-token behaviour log-probs and policy versions.

    Invariant: every token returned by ``generate`` is tagged with the ``version``
    that was current when the token was sampled.
    """

    version: int

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, each with ``params.n`` completions."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights (HF parameter names) and set the policy version."""
        ...
