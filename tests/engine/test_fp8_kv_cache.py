"""``kv_cache_dtype="fp8"`` (engine/attention.py, model_runner.py), CPU: K/V cached in e4m3 at a
quarter of an fp32 cache's bytes per block (half of bf16's); forked samples (their partial prompt
block copied byte for byte) and the prefix cache work on it; the log-prob mismatch against the HF
model is measured (more than the unquantized engine's, less than FP8 weights'); unknown dtypes are
refused by name."""
import pytest
import torch

from asyncrl.engine.attention import FP8_KV

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
