"""LoRA on the trainer's side, through PEFT (the library verl, OpenRLHF and TRL users already know).

    policy = apply_lora(model, cfg.actor.lora)        # a peft.PeftModel: base frozen, A and B trainable
    trainable_parameters(policy)                        # what the optimizer sees: the adapters only
    AdapterDisabledReference(policy, ...)               # the reference = the same base, adapters off
    sync_tensors(policy)                                # what a weight sync moves: A and B (KBs-MBs)
    merged_tensors(policy)                              # W + (α/r)·B·A of each adapted layer (merged mode)
    iter_merged_tensors(policy)                         # the same, one layer at a time (gathered under FSDP2)
    save_merged(policy, directory)                      # an HF checkpoint of the merged model

Under FSDP2 (trainer.strategy=fsdp2) the same PEFT model is sharded whole (lora_sharded.py
gathers its adapters for a push or a checkpoint).

Everything but :func:`apply_lora` reads PEFT's module layout by duck typing (``peft_config``,
``base_layer``, ``lora_A``/``lora_B``/``scaling`` per adapter), so this module imports peft only
to wrap a model.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator, Optional

import torch

from asyncrl.config_schema import ConfigError
from asyncrl.distributed.gather import gather_whole
from asyncrl.distributed.group import SINGLE, DataParallel
from asyncrl.training.forward import PolicyLogprobs
from asyncrl.training.reference import Reference
from asyncrl.types import TrainBatch

PEFT_PREFIX = "base_model.model."  # PeftModel's names: base_model (LoraModel) . model (the HF model) . <HF name>


def apply_lora(model: torch.nn.Module, lora_cfg) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with ``lora_cfg`` (an ``actor.lora`` config):
    base weights frozen (``requires_grad=False``), fresh adapters (A random, B zero: the wrapped
    model computes exactly what ``model`` did) trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:  # pragma: no cover - peft is a dependency; a broken install says so
        raise ConfigError("actor.lora needs the peft package: pip install peft") from None
    targets = lora_cfg.target_modules
    peft_cfg = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                          target_modules=targets[0] if targets == ["all-linear"] else list(targets),
                          bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:  # e.g. "Target modules {...} not found in the base model"
        raise ConfigError(f"actor.lora.target_modules={targets}: {str(err).splitlines()[0]}") from None


def is_lora(model) -> bool:
    """True for a PEFT model with LoRA layers (``apply_lora``'s result or ``PeftModel.from_pretrained``'s)."""
    return hasattr(model, "peft_config") and any(True for _ in lora_layers(model))


def lora_layers(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, PEFT LoRA layer) of every adapted linear, in module order."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and len(module.lora_A):
            yield name.removeprefix(PEFT_PREFIX), module


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: all of a plain model's, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Every adapter tensor (``...q_proj.lora_A.default.weight`` and so on), named as in
    ``model.named_parameters()``: the bytes a LoRA weight sync moves."""
    return [(name, p) for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def sync_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a weight sync moves from the trainer: the adapters of a LoRA model, else every parameter."""
    return adapter_tensors(model) if is_lora(model) else list(model.named_parameters())


@torch.no_grad()
def merged_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(HF weight name, W + scale·B·A) of every adapted linear, in W's dtype; the product in fp32.
    What an engine serving the merged model loads (``actor.lora.merged_rollout``)."""
    return list(iter_merged_tensors(model))


@torch.no_grad()
def iter_merged_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_tensors` one layer at a time. Under FSDP2 (DTensor shards) each layer's W,
    A and B are gathered whole (one all-gather per layer, distributed/gather.py: a collective,
    every rank iterates the whole stream in the same order), so the extra memory is one layer."""
    for name, layer in lora_layers(model):
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        weight, *pairs = gather_whole([layer.base_layer.weight.detach(),
                                       *(p for a in adapters for p in (layer.lora_A[a].weight.detach(),
                                                                       layer.lora_B[a].weight.detach()))])
        scaled = [(layer.scaling[adapter], a, b) for adapter, a, b in zip(adapters, pairs[0::2], pairs[1::2])]
        yield f"{name}.weight", merged_weight(weight, scaled)


def merged_weight(weight: torch.Tensor, adapters: list[tuple[float, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """W + Σ scale·B·A over ``adapters`` (scale, A ``[r, in]``, B ``[out, r]``), the sum in fp32,
    returned in W's dtype ``[out, in]``."""
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for scale, a, b in adapters:
        delta += scale * (b.float() @ a.float())
    return (weight.float() + delta).to(weight.dtype)


def save_merged(model, directory: Path, tokenizer=None) -> Path:
    """The merged model as an HF checkpoint in ``directory`` (``AutoModelForCausalLM`` loads it),
    from a copy: the trainer's PEFT model keeps its adapters unmerged."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return Path(directory)


class AdapterDisabledReference(Reference):
    """The frozen reference of a LoRA policy: the policy's own base weights with its adapters
    disabled (PEFT's ``disable_adapter()``), so no second copy of the weights exists.

    Invariant: its log-probs are those of the base model, which no update changes (the
    optimizer holds only adapter parameters).

    ``forward``/``dp``: under FSDP2, the actor's own sharded module (its base shards serve as
    the reference's: still no copy)."""

    def __init__(self, model, temperature: float, micro_batch_size: int, chunk_tokens: int, *,
                 forward: Optional[torch.nn.Module] = None, dp: DataParallel = SINGLE):
        super().__init__(model, temperature, micro_batch_size, chunk_tokens, dp=dp,
                         forward=forward if forward is not None else PolicyLogprobs(model))  # the actor's own

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()  # no adapter dropout (disabled anyway) nor any other train-mode behaviour
        try:
            with self.model.disable_adapter():
                return super().compute_logprobs(batch)
        finally:
            self.model.train(was_training)
