"""Build a ``CausalLM`` from an HF checkpoint directory: config.json + *.safetensors."""
from __future__ import annotations

import glob
import os
from typing import Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from asyncrl.engine.fp8_linear import quantize_linears
from asyncrl.engine.lora import base_tensors, is_peft_module
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import CausalLM
from asyncrl.engine.models.registry import model_class
from asyncrl.engine.parallel.layout import SINGLE, TensorParallel


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every shard, one at a time."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def model_source(path) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]], Optional[torch.dtype]]:
    """(config, HF-named tensors, the source's dtype) of a checkpoint dir or an in-memory HF
    ``*ForCausalLM`` module (its config and state dict; e.g. the trainer's policy)."""
    if isinstance(path, torch.nn.Module):
        base = path.get_base_model() if is_peft_module(path) else path  # a PEFT model: its base (adapters: engine/lora.py)
        config = ModelConfig.from_module(base)
        return config, base_tensors(path.state_dict().items()), next(path.parameters()).dtype
    config = ModelConfig.from_dir(path)
    return config, iter_safetensors(path), getattr(torch, config.torch_dtype.replace("torch.", ""), torch.float32)


class AllocateIn(TorchFunctionMode):
    """Factory calls without a dtype (``torch.empty/zeros/ones``: what ``nn.Linear``,
    ``nn.Embedding`` and ``nn.Parameter(torch.ones(d))`` allocate with) make ``dtype`` tensors.

    Why: a model built in the default fp32 and then cast takes 2x its bf16 size on the device at
    once (Qwen3-30B-A3B: 122 GB of fp32 parameters for 61 GB of bf16), and the freed fp32 blocks
    stay in PyTorch's caching allocator, where ``mem_get_info`` counts them as used (the KV pool
    got 6.5 GB of an H200's ~60 free). Unlike ``torch.set_default_dtype`` this mode is
    thread-local: a trainer thread building tensors meanwhile keeps fp32. Explicit dtypes (the
    fp32 RoPE tables) are left alone."""

    _FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn)

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                tp: TensorParallel = SINGLE, quantization: Optional[str] = None,
                fp8_scaling: str = "block") -> CausalLM:
    """This rank's share of the model, allocated on ``device`` in ``dtype`` (each parameter
    once: ``AllocateIn``) and not yet filled; ``quantization`` "fp8": the decoder layers' linears
    store e4m3 weights scaled per ``fp8_scaling`` (block / channel), quantized as they are filled
    (engine/fp8_linear.py)."""
    with torch.device(device), AllocateIn(dtype):
        cls = model_class(config)
        model = cls(config, tp) if tp.size > 1 else cls(config)
    model.to(dtype=dtype)
    # RoPE tables stay fp32: positions up to max_pos need the precision
    model.model.rotary_emb.float()
    quantize_linears(model, quantization, fp8_scaling)  # after .to(dtype): it would cast the e4m3 weights
    return model


def fill_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> CausalLM:
    """Load full HF tensors into ``model`` (each rank keeps its slice); every parameter must
    be filled (shards of fused ones each count)."""
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


def load_model(path, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu",
               tp: TensorParallel = SINGLE, quantization: Optional[str] = None,
               fp8_scaling: str = "block") -> CausalLM:
    """Build from a checkpoint dir, or from an in-memory HF ``*ForCausalLM`` module (its
    config and state dict; e.g. the trainer's policy); ``tp``: this rank's share only.

    Parameters are allocated on ``device`` and filled from the checkpoint; every
    parameter must be filled (shards of fused ones each count)."""
    config, tensors, source_dtype = model_source(path)
    return fill_weights(build_model(config, dtype or source_dtype, device, tp, quantization, fp8_scaling), tensors)
