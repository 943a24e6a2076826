"""Build a ``CausalLM`` from an HF checkpoint directory: config.json + *.safetensors."""
from __future__ import annotations

import glob
import os
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from asyncrl.engine.lora import base_tensors, is_peft_module
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import CausalLM
from asyncrl.engine.models.registry import model_class


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every shard, one at a time."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu") -> CausalLM:
    """Build from a checkpoint dir, or from an in-memory HF ``*ForCausalLM`` module (its
    config and state dict; e.g. the trainer's policy).

    Parameters are allocated on ``device`` and filled from the checkpoint; every
    parameter must be filled (shards of fused ones each count)."""
    if isinstance(path, torch.nn.Module):
        hf = path
        base = hf.get_base_model() if is_peft_module(hf) else hf  # a PEFT model: its base (adapters: engine/lora.py)
        config = ModelConfig.from_module(base)
        tensors = base_tensors(hf.state_dict().items())
        dtype = dtype or next(hf.parameters()).dtype
    else:
        config = ModelConfig.from_dir(path)
        tensors = iter_safetensors(path)
        dtype = dtype or getattr(torch, config.torch_dtype.replace("torch.", ""), torch.float32)
    with torch.device(device):
        model = model_class(config)(config)
    model.to(dtype=dtype)
    # RoPE tables stay fp32: positions up to max_pos need the precision
    model.model.rotary_emb.float()
    loaded = model.load_weights(tensors)
    # fused params take several tensors (qkv: 3, gate_up: 2); the tied head none; families with
    # other fused or packed parameters count their own (``expected_tensors``)
    if hasattr(model, "expected_tensors"):
        expected = model.expected_tensors()
    else:
        expected = sum(3 if "qkv_proj.weight" in n or "qkv_proj.bias" in n else 2 if "gate_up" in n else 1
                       for n, _ in model.named_parameters())
    if loaded != expected:
        raise ValueError(f"checkpoint filled {loaded} tensors, the model needs {expected}")
    return model.eval()
