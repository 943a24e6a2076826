"""Rollout backends by config name (``rollout.backend``).

``auto`` picks the asyncrl engine for the architectures it implements (``engine.models``:
Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE) and HF ``generate`` for any
other ``AutoModelForCausalLM`` (static KV cache on GPU), saying so once per architecture.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from asyncrl.rollout.base import RolloutBackend

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _announce_fallback(architecture: str) -> None:
    logger.warning("rollout: %s is not implemented by the asyncrl engine, so rollouts use HF generate "
                   "(static KV cache on GPU; ~10x slower than the engine; docs/models.md)", architecture)


def _auto(architecture: str) -> str:
    from asyncrl.engine.models import ARCHITECTURES

    if architecture in ARCHITECTURES:
        return "engine"
    _announce_fallback(architecture or "an unnamed architecture")
    return "hf"


def _hf(model, tokenizer, **_engine_options) -> RolloutBackend:
    from asyncrl.rollout.hf import HFGenerateBackend
    for option, key in (("speculative_config", "rollout.speculative"), ("quantization", "rollout.quantization"),
                        ("kv_cache_dtype", "rollout.kv_cache_dtype"), ("fused_kv_write", "rollout.fused_kv_write"),
                        ("decode_graph_sampler", "rollout.decode_graph_sampler"),
                        ("mamba_ssm_cache_dtype", "rollout.mamba_ssm_cache_dtype")):
        if _engine_options.get(option):
            raise ValueError(f"{key} needs the asyncrl engine; this model runs on HF generate "
                             "(rollout.backend hf, or an architecture the engine does not implement)")
    return HFGenerateBackend(model, tokenizer)  # shares the trainer's tensors: no weight copy


def _engine(model, tokenizer, **engine_options) -> RolloutBackend:
    from asyncrl.rollout.engine_backend import EngineBackend
    return EngineBackend(model, tokenizer, **engine_options)  # own copy of the weights, refreshed by update_weights


def _openai(model, tokenizer, openai=None, **_engine_options) -> RolloutBackend:
    from asyncrl.rollout.openai_backend import build_openai_backend
    return build_openai_backend(openai)  # the server holds its own weights; pushed by update_weights


# the engine's stream priority under rollout.engine_stream=high_priority: -1 is above the default stream's 0
# (torch maps it onto the device's range; lower = more urgent)
HIGH_STREAM_PRIORITY = -1


def engine_stream_priority(engine_stream: str, async_thread: bool) -> Optional[int]:
    """``EngineConfig.stream_priority`` for ``rollout.engine_stream`` (None: the caller's stream).

    auto: a stream of its own only for an engine that runs in a thread of the trainer's process in
    async mode (``async_thread``), where the rollout's decode (small, latency-bound kernels, most
    SMs idle) and the trainer's update (large GEMMs) share one GPU at the same time: on the one
    default stream they ran one after the other, kernel by kernel (issue 20: on one H200 the update
    took 0.93 s instead of 0.49 s and the rollout 1.25 s instead of 0.72 s). In sync mode the
    two alternate in one thread, so there is nothing to overlap, and the engine's own stream would
    keep the memory it caches for its activations out of the trainer's reach."""
    if engine_stream == "high_priority" or (engine_stream == "auto" and async_thread):
        return HIGH_STREAM_PRIORITY
    return None


def engine_options(rollout_cfg, lora_cfg=None) -> dict:
    """``EngineConfig`` fields set from the ``rollout`` config section (the server's settings
    for ``openai``; with ``actor.lora``: serve the adapter merged into the weights, or apply it
    on the fly)."""
    if rollout_cfg.backend == "openai":
        return {"openai": rollout_cfg.openai}
    options = {"gpu_memory_utilization": rollout_cfg.gpu_memory_utilization,
               "return_routed_experts": rollout_cfg.return_routed_experts,
               "speculative_config": rollout_cfg.speculative.engine_dict(),
               "quantization": None if rollout_cfg.quantization == "none" else rollout_cfg.quantization,
               "fp8_scaling": rollout_cfg.fp8_scaling,
               "kv_cache_dtype": None if rollout_cfg.kv_cache_dtype == "auto" else rollout_cfg.kv_cache_dtype,
               "fused_kv_write": rollout_cfg.fused_kv_write,
               "decode_graph_sampler": rollout_cfg.decode_graph_sampler,
               "mamba_ssm_cache_dtype": None if rollout_cfg.mamba_ssm_cache_dtype == "auto"
               else rollout_cfg.mamba_ssm_cache_dtype,
               # auto: none here; the async runtime's in-process engine asks for its own (async_controller.py)
               "stream_priority": engine_stream_priority(rollout_cfg.engine_stream, async_thread=False)}
    if lora_cfg is not None and lora_cfg.enabled:
        options["merge_lora"] = lora_cfg.merged_rollout
    return options


BACKENDS = {"hf": _hf, "engine": _engine, "openai": _openai}


def resolve_backend_name(name: str, model) -> str:
    """``auto``: the asyncrl engine for the architectures it implements, else HF generate."""
    if name != "auto":
        return name
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return _auto(architectures[0])


def resolve_backend_name_for_path(name: str, path) -> str:
    """``auto`` for a checkpoint directory, from the architecture in its config.json."""
    if name != "auto":
        return name
    import json
    from pathlib import Path

    architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures") or [""]
    return _auto(architectures[0])


def build_backend(name: str, model, tokenizer, **engine_options) -> RolloutBackend:
    """A rollout backend holding the weights of ``model`` (HF module) at version 0;
    ``engine_options`` (see :func:`engine_options`) reach the engine only."""
    name = resolve_backend_name(name, model)
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r} (known: {sorted(BACKENDS)})")
    return BACKENDS[name](model, tokenizer, **engine_options)
