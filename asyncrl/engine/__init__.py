"""asyncrl's rollout engine: paged KV, continuous batching, prefix sharing, RL controls.

Public API: ``LLM`` (generate / update_weights / pause / resume / abort), ``EngineConfig``.
"""
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.llm import LLM

__all__ = ["LLM", "EngineConfig"]
