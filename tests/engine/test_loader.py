"""models/loader.py: a model is allocated once, in its dtype (no fp32 build then cast)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.loader import build_model

TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=1024, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


class Fp32Allocations(TorchDispatchMode):
    """Bytes of the fp32 tensors created with new storage (not views) while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not any(r.alias_info for r in func._schema.returns)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if fresh and isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.bytes += t.numel() * 4
        return out


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3ForCausalLM"])
def test_build_model_allocates_parameters_in_the_target_dtype(arch):
    config = ModelConfig.from_dict({**TINY_MOE, "architectures": [arch]})
    with Fp32Allocations() as seen:
        model = build_model(config, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    rope = 2 * 64 * 16 * 4  # cos + sin [max_pos, head_dim] fp32
    # only the RoPE tables (and their few intermediates) are fp32; a build-then-cast made ~params x 4 B
    assert seen.bytes <= 6 * rope < params * 4 / 4
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # the build left the process default alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_build_peaks_at_the_bf16_size_and_leaves_no_cache():
    """On CUDA the build's peak is the bf16 parameters (an fp32 build then cast peaked at ~3x and
    left the fp32 blocks in the allocator cache, where mem_get_info counts them as used)."""
    from asyncrl.engine.kv_budget import device_memory

    config = ModelConfig.from_dict({**TINY_MOE, "vocab_size": 32768, "hidden_size": 512, "moe_intermediate_size": 256,
                                    "num_experts": 64})
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, torch.bfloat16, "cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert torch.cuda.max_memory_allocated() - base <= 1.1 * (params + buffers) + 2**20
    free, _ = device_memory(torch.device("cuda"))
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 24 * 2**20  # cache handed back (fragments stay)
    assert free > 0
