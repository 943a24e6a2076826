"""Which engine model class implements an architecture (``config.json``'s ``architectures[0]``).

The dense decoder (``decoder.CausalLM``) covers Qwen3 / Qwen2 / Llama / Mistral; families with
their own layers have their own file. An architecture listed nowhere here is not run by the
engine: ``rollout.backend=auto`` sends it to HF ``generate`` (``rollout/registry.py``).
"""
from __future__ import annotations

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import CausalLM

_HYBRID = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
           "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def model_class(config: ModelConfig) -> type[CausalLM]:
    if config.architecture in _HYBRID:
        from asyncrl.engine.models.qwen3_5 import Qwen3_5ForCausalLM
        return Qwen3_5ForCausalLM
    if config.architecture == "Qwen3MoeForCausalLM":
        from asyncrl.engine.models.moe import Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM
    return CausalLM


def is_hybrid(config: ModelConfig) -> bool:
    """Has recurrent (Gated DeltaNet) layers: per-sequence state slots, no prefix cache."""
    return config.architecture in _HYBRID
