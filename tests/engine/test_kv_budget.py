"""KV-pool sizing arithmetic (kv_budget.py, ModelRunner._num_kv_blocks) on CPU, with the CUDA
memory queries mocked: hand-derived numbers for a dense and an MoE config."""
from types import SimpleNamespace

import pytest
import torch

from asyncrl.engine import kv_budget
from asyncrl.engine.kv_budget import GB, KvBudget, activation_bytes
from asyncrl.engine.models.config import ModelConfig

# Qwen3-30B-A3B's numbers (config.json of the release)
MOE_30B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
DENSE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def test_dense_headroom_is_the_engines_estimate():
    c = ModelConfig.from_dict(DENSE)
    # 16384 tokens x 32 B x (1024 + 3072) + 256 rows x 151936 x 4 B x 6
    assert activation_bytes(c, 2, 16384, 256) == 16384 * 32 * 4096 + 256 * 151936 * 24


def test_moe_headroom_counts_routed_rows_not_the_dense_width():
    c = ModelConfig.from_dict(MOE_30B)
    # per token: trunk 32 x 2048 = 65,536; MoE 2 B x 8 x (4 x 768 + 2048) = 81,920 (gate_up 2I, silu I,
    # h I, expert out H per routed row) + fp32 router 4 x 2 x 128 = 1,024 -> 148,480 (dense: 262,144)
    assert activation_bytes(c, 2, 16384, 256) == 16384 * 148480 + 256 * 151936 * 24
    with_dense = ModelConfig.from_dict({**MOE_30B, "mlp_only_layers": [0]})  # a dense layer: its width counts
    assert activation_bytes(with_dense, 2, 16384, 256) == 16384 * 32 * (2048 + 6144) + 256 * 151936 * 24


def test_budget_blocks_from_free_memory():
    # an H200 after loading the 30B model: 61 GB of weights, 79 GB free, 0.9 utilisation
    block = 2 * 48 * 64 * 4 * 128 * 2  # K+V x layers x block 64 x 4 KV heads x 128 x bf16 = 6 MiB
    b = KvBudget(weights=61 * GB, free=79 * GB, total=140 * GB, reserve=14 * GB, activations=3 * GB,
                 block_bytes=block, wanted_blocks=100_000)
    assert b.blocks == (62 * GB) // block == 10581  # 62 GiB / 6 MiB
    assert b.line(64).startswith("KV pool: weights 61.0 GiB, free 79.0 of 140.0 GiB, reserve 14.0 GiB, "
                                 "activation headroom 3.0 GiB -> 10581 blocks x 64 = 677,184 tokens")
    assert KvBudget(0, 79 * GB, 140 * GB, 14 * GB, 3 * GB, block, 2304).blocks == 2304  # workload (a) fits
    assert KvBudget(0, 10 * GB, 140 * GB, 14 * GB, 3 * GB, block, 2304).blocks == 16  # nothing left: the floor


def test_device_memory_empties_the_cache_first_and_counts_cached_fragments(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("info") or (20 * GB, 140 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 63 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 61 * GB)
    assert kv_budget.device_memory(torch.device("cuda:0")) == (22 * GB, 140 * GB)
    assert calls == ["sync", "empty", "info"]


def test_model_runner_sizes_an_moe_pool_from_the_budget(monkeypatch):
    from asyncrl.engine.config import EngineConfig
    from asyncrl.engine.model_runner import ModelRunner

    c = ModelConfig.from_dict({**MOE_30B, "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128,
                               "num_experts": 8, "moe_intermediate_size": 32})
    model = SimpleNamespace(config=c)
    monkeypatch.setattr("asyncrl.engine.model_runner.module_bytes", lambda m: 5 * GB)
    monkeypatch.setattr("asyncrl.engine.model_runner.device_memory", lambda device: (40 * GB, 80 * GB))
    runner = SimpleNamespace(config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024, block_size=16,
                                                 gpu_memory_utilization=0.9),
                             max_model_len=1000, block_size=16, is_cuda=True, device=None, model=model,
                             dtype=torch.bfloat16, _block_bytes=lambda: 1 << 20)
    blocks = ModelRunner._num_kv_blocks(runner)
    act = 1024 * (32 * 64 + 2 * 8 * (4 * 32 + 64) + 4 * 2 * 8) + 256 * 128 * 24
    usable = 40 * GB - int(80 * GB * (1 - 0.9)) - act
    assert runner.kv_budget.activations == act
    assert blocks == min(256 * 63, usable // (1 << 20)) == 256 * 63  # 63 blocks of 16 per 1000-token sequence
    assert runner.kv_budget.weights == 5 * GB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_width_of_a_shared_expert(dtype):
    c = ModelConfig.from_dict({**MOE_30B, "hidden_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16})
    b = dtype.itemsize
    assert kv_budget.moe_width(c, b) == b * (2 * (4 * 8 + 32) + 3 * 16) + 4 * 2 * 4
