"""Backends by config name: ``auto`` picks the engine for Qwen3, and the rollout section's
engine options reach the engine (and only the engine)."""
import pytest
import torch

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


def test_rollout_speculative_reaches_the_engine(tiny_policy):
    """``rollout.speculative.*`` becomes vLLM's speculative_config dict; off by default."""
    model, tok = tiny_policy
    assert build_backend("engine", model, tok, **engine_options(load_config("quickstart").rollout)).llm.spec is None
    cfg = load_config("quickstart", ["rollout.speculative.method=ngram", "rollout.speculative.num_speculative_tokens=3"])
    spec = build_backend("engine", model, tok, **engine_options(cfg.rollout)).llm.spec
    assert spec.k == 3 and spec.config.method == "ngram" and spec.config.disable_by_batch_size == 32
    with pytest.raises(ValueError, match="rollout.speculative needs the asyncrl engine"):
        build_backend("hf", model, tok, **engine_options(cfg.rollout))


def test_auto_falls_back_to_hf_generate_with_one_line(caplog):
    """An architecture the engine does not implement goes to HF generate, said once, with why;
    the new families go to the engine."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    from asyncrl.rollout import registry

    registry._announce_fallback.cache_clear()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.registry"):
        assert resolve_backend_name("auto", gpt2) == "hf"
        assert resolve_backend_name("auto", gpt2) == "hf"
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.rollout.registry"]  # not transformers' config warnings
    assert len(lines) == 1 and "GPT2LMHeadModel" in lines[0] and "HF generate" in lines[0]

    class _Cfg:
        def __init__(self, arch):
            self.config = type("C", (), {"architectures": [arch]})()
    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3MoeForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration"):
        assert resolve_backend_name("auto", _Cfg(arch)) == "engine"


def test_hf_fallback_static_cache_generates_the_same_tokens(tiny_policy):
    """The static KV cache (on by default on GPU) changes no token: greedy equals the dynamic cache."""
    from asyncrl.types import SamplingParams

    model, tok = tiny_policy
    assert not HFGenerateBackend(model, tok)._use_static_cache()  # CPU: dynamic by default
    params = SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]
    dynamic = HFGenerateBackend(model, tok, static_cache=False).generate(prompts, params)
    static = HFGenerateBackend(model, tok, static_cache=True).generate(prompts, params)
    assert [[c.token_ids for c in o.completions] for o in static] == \
        [[c.token_ids for c in o.completions] for o in dynamic]


def test_rollout_fp8_reaches_the_engine_and_needs_a_correction(tiny_policy):
    """``rollout.quantization`` / ``rollout.kv_cache_dtype`` = fp8 build an FP8 engine (HF generate
    refuses them), and the config check asks for the TIS correction a quantized rollout needs."""
    from asyncrl.config import ConfigError
    from asyncrl.engine.fp8_linear import Fp8Linear
    from asyncrl.runtime.validate import validate_config

    model, tok = tiny_policy
    fp8 = ["rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8"]
    uncorrected = ["algorithm.decoupled=false", "algorithm.rollout_correction.level=none"]
    validate_config(load_config("quickstart", uncorrected))
    with pytest.raises(ConfigError, match="rollout_correction.level=token"):
        validate_config(load_config("quickstart", fp8 + uncorrected))
    cfg = load_config("quickstart", fp8)  # the quickstart recipe corrects (token-level)
    validate_config(cfg)
    llm = build_backend("engine", model, tok, **engine_options(cfg.rollout)).llm
    assert isinstance(llm.model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert llm.runner.kv_dtype == torch.float8_e4m3fn
    assert llm.model.model.layers[0].mlp.down_proj.scaling.name == "block"  # the default
    with pytest.raises(ConfigError, match="rollout.fp8_scaling=channel scales FP8 weights, but rollout.quantization=none"):
        validate_config(load_config("quickstart", ["rollout.fp8_scaling=channel"]))
    channel = load_config("quickstart", fp8 + ["rollout.fp8_scaling=channel"])
    validate_config(channel)
    layer = build_backend("engine", model, tok, **engine_options(channel.rollout)).llm.model.model.layers[0].mlp.down_proj
    assert layer.scaling.name == "channel" and layer.weight_scale_inv.shape == (layer.weight.shape[0], 1)
    default = build_backend("engine", model, tok, **engine_options(load_config("quickstart").rollout)).llm
    assert not isinstance(default.model.model.layers[0].mlp.down_proj, Fp8Linear)
    with pytest.raises(ValueError, match="rollout.quantization needs the asyncrl engine"):
        build_backend("hf", model, tok, **engine_options(cfg.rollout))


def test_rollout_mamba_ssm_cache_dtype_reaches_the_engine_options(tiny_policy):
    """``rollout.mamba_ssm_cache_dtype`` (the Qwen3.5 state's dtype) is an engine option: auto -> None
    (the engine resolves it from the checkpoint), a named dtype passes through, HF generate refuses it."""
    model, tok = tiny_policy
    assert engine_options(load_config("quickstart").rollout)["mamba_ssm_cache_dtype"] is None
    options = engine_options(load_config("quickstart", ["rollout.mamba_ssm_cache_dtype=bfloat16"]).rollout)
    assert options["mamba_ssm_cache_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="rollout.mamba_ssm_cache_dtype needs the asyncrl engine"):
        build_backend("hf", model, tok, **options)


def test_engine_stream_auto_is_own_high_priority_only_for_an_async_thread():
    """rollout.engine_stream: auto gives the engine its own high-priority stream only where it
    runs beside the trainer in the trainer's process (async, thread executor); caller never;
    high_priority always (engine_options carries it to every engine the run builds)."""
    from asyncrl.config import load_config
    from asyncrl.rollout.registry import HIGH_STREAM_PRIORITY, engine_stream_priority

    assert HIGH_STREAM_PRIORITY < 0  # above the default stream's priority 0
    assert engine_stream_priority("auto", async_thread=True) == HIGH_STREAM_PRIORITY
    assert engine_stream_priority("auto", async_thread=False) is None
    assert engine_stream_priority("caller", async_thread=True) is None
    assert engine_stream_priority("high_priority", async_thread=False) == HIGH_STREAM_PRIORITY
    assert engine_options(load_config("quickstart").rollout)["stream_priority"] is None
    cfg = load_config("quickstart", ["rollout.engine_stream=high_priority"])
    assert engine_options(cfg.rollout)["stream_priority"] == HIGH_STREAM_PRIORITY


def test_rollout_fused_kv_write_reaches_the_engine_config(tiny_policy):
    """``rollout.fused_kv_write=true`` becomes ``EngineConfig.fused_kv_write`` (used on CUDA only: the CPU
    engine keeps the torch path); HF generate refuses it by name."""
    model, tok = tiny_policy
    options = engine_options(load_config("quickstart", ["rollout.fused_kv_write=true"]).rollout)
    assert options["fused_kv_write"] is True
    assert engine_options(load_config("quickstart").rollout)["fused_kv_write"] is None
    llm = build_backend("engine", model, tok, **options).llm
    assert llm.config.fused_kv_write and not llm.model.model.layers[0].self_attn.fused_kv_write  # CPU
    with pytest.raises(ValueError, match="rollout.fused_kv_write needs the asyncrl engine"):
        build_backend("hf", model, tok, **options)


def test_rollout_decode_graph_sampler_reaches_the_engine_config(tiny_policy):
    """``rollout.decode_graph_sampler=true`` becomes ``EngineConfig.decode_graph_sampler`` (CUDA graphs
    only: the CPU engine samples after the forward either way); HF generate refuses it by name."""
    model, tok = tiny_policy
    options = engine_options(load_config("quickstart", ["rollout.decode_graph_sampler=true"]).rollout)
    assert options["decode_graph_sampler"] is True
    assert engine_options(load_config("quickstart").rollout)["decode_graph_sampler"] is None
    llm = build_backend("engine", model, tok, **options).llm
    assert llm.config.decode_graph_sampler and not llm.runner.graph_sampler  # CPU
    with pytest.raises(ValueError, match="rollout.decode_graph_sampler needs the asyncrl engine"):
        build_backend("hf", model, tok, **options)
