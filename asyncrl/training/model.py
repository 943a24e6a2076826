"""Building, saving and loading policy models through the real HF paths.

A tiny model is a ``Qwen3ForCausalLM`` built from a config with random weights; it is
saved with ``save_pretrained`` (safetensors) and loaded back with
``AutoModelForCausalLM.from_pretrained`` exactly like a real local checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_model(tiny_cfg, tokenizer, seed: int):
    """A randomly initialised model sized by ``tiny_cfg`` (a ``TinyModelConfig``): Qwen3, or Qwen3.5
    (``architecture: qwen3_5``; its linear-attention layers get key heads = KV heads, value heads =
    attention heads, head dims = head_dim)."""
    if getattr(tiny_cfg, "architecture", "qwen3") == "qwen3_5":
        return _tiny_qwen3_5(tiny_cfg, tokenizer, seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=tiny_cfg.hidden_size,
        intermediate_size=tiny_cfg.intermediate_size, num_hidden_layers=tiny_cfg.num_hidden_layers,
        num_attention_heads=tiny_cfg.num_attention_heads, num_key_value_heads=tiny_cfg.num_key_value_heads,
        head_dim=tiny_cfg.head_dim, max_position_embeddings=tiny_cfg.max_position_embeddings,
        rope_theta=tiny_cfg.rope_theta, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def _tiny_qwen3_5(tiny_cfg, tokenizer, seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=tiny_cfg.hidden_size, intermediate_size=tiny_cfg.intermediate_size,
        num_hidden_layers=tiny_cfg.num_hidden_layers, num_attention_heads=tiny_cfg.num_attention_heads,
        num_key_value_heads=tiny_cfg.num_key_value_heads, head_dim=tiny_cfg.head_dim,
        linear_num_key_heads=tiny_cfg.num_key_value_heads, linear_num_value_heads=tiny_cfg.num_attention_heads,
        linear_key_head_dim=tiny_cfg.head_dim, linear_value_head_dim=tiny_cfg.head_dim,
        max_position_embeddings=tiny_cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": tiny_cfg.rope_theta, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(config)


def load_policy(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) from a local HF checkpoint directory."""
    path = str(path)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model path '{path}' is not a directory with config.json and weights")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype]).to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
