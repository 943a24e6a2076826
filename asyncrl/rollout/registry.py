"""Rollout backends by config name (``rollout.backend``)."""
from __future__ import annotations

from asyncrl.rollout.base import RolloutBackend


def _hf(model, tokenizer) -> RolloutBackend:
    from asyncrl.rollout.hf import HFGenerateBackend
    return HFGenerateBackend(model, tokenizer)  # shares the trainer's tensors: no weight copy


def _engine(model, tokenizer) -> RolloutBackend:
    from asyncrl.rollout.engine_backend import EngineBackend
    return EngineBackend(model, tokenizer)  # own copy of the weights, refreshed by update_weights


BACKENDS = {"hf": _hf, "engine": _engine}


def build_backend(name: str, model, tokenizer) -> RolloutBackend:
    """A rollout backend holding the weights of ``model`` (HF module) at version 0."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r} (known: {sorted(BACKENDS)})")
    return BACKENDS[name](model, tokenizer)
