"""Tiny random checkpoints of the Qwen3.5 / Qwen3-MoE / Qwen3.5-MoE families (fp32, CPU).

Shapes keep every structural feature small: 4 layers (3 Gated DeltaNet + 1 gated attention, the
released 3:1 pattern), 2 k-heads shared by 4 v-heads, partial RoPE (4 of 16 dims), 8 experts
top-2 (one dense layer in Qwen3-MoE through ``mlp_only_layers``), a shared expert in Qwen3.5-MoE.
"""
from __future__ import annotations

import torch

from asyncrl.training.hf_kernels import route_cpu_to_torch_kernels

# the HF references run on the CPU: transformers' torch delta rule and conv even where fla-core is
# installed (a GPU machine), instead of FLA's Triton kernels, which cannot read CPU tensors
route_cpu_to_torch_kernels()

VOCAB = 97
FAMILIES = ["qwen3_5", "qwen3_moe", "qwen3_5_moe"]
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, eos_token_id=3, bos_token_id=1, pad_token_id=0)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def family_config(family: str):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3MoeConfig

    if family == "qwen3_5":
        return Qwen3_5TextConfig(num_hidden_layers=4, intermediate_size=128, tie_word_embeddings=True,
                                 **_GDN, **_COMMON)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1],
                              tie_word_embeddings=False, **_MOE, **_COMMON)
    return Qwen3_5MoeTextConfig(num_hidden_layers=4, shared_expert_intermediate_size=48, tie_word_embeddings=False,
                                **_GDN, **_MOE, **_COMMON)


def build_family(family: str, path, seed: int = 0) -> str:
    """Save a random ``*ForCausalLM`` of ``family`` to ``path`` (per-expert safetensors names, as
    transformers 5 writes them) with weights large enough that next-token distributions are peaked."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if p.shape[0] == VOCAB else 0.15)
            elif "norm" in name:  # zero-centred norms: non-trivial weights either way
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return str(path)
