"""``kv_cache_dtype="fp8"`` (engine/attention.py, model_runner.py), CPU: K/V cached in e4m3 at a
quarter of an fp32 cache's bytes per block (half of bf16's); forked samples (their partial prompt
block copied byte for byte) and the prefix cache work on it; the log-prob mismatch against the HF
model is measured (more than the unquantized engine's, less than FP8 weights'); unknown dtypes are
refused by name."""
import pytest
import torch

from asyncrl.engine.attention import FP8_KV
from asyncrl.types import SamplingParams

from conftest import make_llm, prompts_for
from test_fp8_linear import mean_mismatch


def test_fp8_kv_cache_generates_within_its_error(tiny_dirs, hf_models):
    hf, prompts = hf_models["qwen3"], prompts_for(0, [5, 9, 7, 12])
    plain, fp8 = make_llm(tiny_dirs["qwen3"]), make_llm(tiny_dirs["qwen3"], kv_cache_dtype="fp8")
    layer = fp8.model.model.layers[0].self_attn
    assert layer.k_cache.dtype == layer.v_cache.dtype == FP8_KV
    assert fp8.runner._block_bytes() * 4 == plain.runner._block_bytes()
    base, kv = mean_mismatch(plain, hf, prompts), mean_mismatch(fp8, hf, prompts)  # n = 2: forks copy blocks
    assert fp8.metrics["forked_prompt_tokens"] > 0
    assert base < 1e-4 < kv < 0.3  # measured: 7.6e-7 and 0.045 (FP8 weights: 0.16)
    both = make_llm(tiny_dirs["qwen3"], kv_cache_dtype="fp8", quantization="fp8")
    assert 1e-3 < mean_mismatch(both, hf, prompts) < 0.5


def test_unknown_kv_cache_dtype_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*knows"):
        make_llm(tiny_dirs["qwen3"], kv_cache_dtype="int8")


def test_fp8_kv_cache_on_the_moe_and_hybrid_families(tmp_path):
    """Their attention layers use the same cache path (Qwen3.5: the full-attention quarter)."""
    from families import build_family

    prompts = prompts_for(0, [5, 9])
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    for family in ("qwen3_moe", "qwen3_5"):
        path = build_family(family, tmp_path / family)
        fp8 = make_llm(path, kv_cache_dtype="fp8")
        assert fp8.runner._attention_layers()[0].k_cache.dtype == FP8_KV
        ours = [c.token_ids for o in fp8.generate(prompts, params) for c in o.completions]
        plain = [c.token_ids for o in make_llm(path).generate(prompts, params) for c in o.completions]
        assert [t[:2] for t in ours] == [t[:2] for t in plain]  # greedy, peaked: FP8 K/V keep the lead tokens
