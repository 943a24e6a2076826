"""Build a ``CausalLM`` from an HF checkpoint directory: config.json + *.safetensors."""
from __future__ import annotations

import glob
import os
from typing import Iterator, Optional

import torch
from safetensors import safe_open

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import CausalLM


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every shard, one at a time."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: str, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu") -> CausalLM:
    """Random-init-free construction: parameters are allocated on ``device`` and then
    filled from the checkpoint (every non-tied parameter must be present)."""
    config = ModelConfig.from_dir(path)
    dtype = dtype or getattr(torch, config.torch_dtype.replace("torch.", ""), torch.float32)
    with torch.device(device):
        model = CausalLM(config)
    model.to(dtype=dtype)
    # RoPE tables stay fp32: positions up to max_pos need the precision
    model.model.rotary_emb.float()
    loaded = model.load_weights(iter_safetensors(path))
    expected = len(list(model.parameters()))
    # fused params count once per shard (qkv: 3, gate_up: 2) -> loaded >= expected
    if loaded < expected:
        raise ValueError(f"checkpoint {path} filled {loaded} tensors, model has {expected} parameters")
    return model.eval()
