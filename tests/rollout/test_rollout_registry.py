"""Backends by config name: ``auto`` picks the engine for Qwen3, and the rollout section's
engine options reach the engine (and only the engine)."""
from asyncrl.config import load_config
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.rollout.registry import build_backend, engine_options, resolve_backend_name


def test_auto_picks_the_engine_for_qwen3(tiny_policy):
    model, _ = tiny_policy
    assert resolve_backend_name("auto", model) == "engine"


def test_rollout_gpu_memory_utilization_reaches_the_engine(tiny_policy):
    model, tok = tiny_policy
    cfg = load_config("quickstart", ["rollout.gpu_memory_utilization=0.3"])
    backend = build_backend("engine", model, tok, **engine_options(cfg.rollout))
    assert backend.llm.config.gpu_memory_utilization == 0.3
    assert isinstance(build_backend("hf", model, tok, **engine_options(cfg.rollout)), HFGenerateBackend)
