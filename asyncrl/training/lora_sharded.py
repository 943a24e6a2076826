"""LoRA under the FSDP2 trainer: the PEFT model is sharded whole (distributed/fsdp.py: its frozen
base in the compute dtype, its adapters in the master dtype), so what leaves the trainer is
gathered here, adapters only wherever the base is not needed:

    full_adapter_tensors(policy)                   A and B of every adapted layer, whole (a push)
    save_adapter(policy, directory, dp)            PEFT's adapter files, written by rank 0
    save_merged(forward, policy, directory, dp)    the merged model as an HF checkpoint, rank 0

Every function here is a collective: every rank calls it, with the same model, in the same
order (distributed/lockstep.py keeps the ranks' calls aligned).
"""
from __future__ import annotations

from pathlib import Path
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from asyncrl.distributed.gather import gather_whole
from asyncrl.distributed.group import DataParallel
from asyncrl.training.lora import PEFT_PREFIX, adapter_tensors, lora_layers, merged_weight


def full_adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """:func:`~asyncrl.training.lora.adapter_tensors` as whole detached tensors: every rank's
    shards of every A and B in ONE all-gather (distributed/gather.py; a tensor per call would pay
    a collective's latency ~500 times at Qwen3-8B's shape), so only the adapters' bytes cross
    the ranks, never the base's."""
    named = adapter_tensors(model)
    return list(zip([name for name, _ in named], gather_whole([p.detach() for _, p in named])))


def save_adapter(model, directory: Path, dp: DataParallel) -> None:
    """Rank 0 writes ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's format:
    ``PeftModel.from_pretrained(base, directory)`` loads it) from the gathered adapters."""
    state = {name: tensor.cpu() for name, tensor in full_adapter_tensors(model)}
    if dp.is_main:
        model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)


@torch.no_grad()
def merged_state(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights of the merged model from a full PEFT ``state`` (names as in
    ``model.state_dict()``): each adapted W becomes W + scale·B·A (fp32 product, W's dtype),
    the adapters are dropped, ``.base_layer.`` disappears from the names."""
    merged = dict(state)
    for name, layer in lora_layers(model):
        key = f"{PEFT_PREFIX}{name}"
        scaled = [(layer.scaling[a], state[f"{key}.lora_A.{a}.weight"], state[f"{key}.lora_B.{a}.weight"])
                  for a in layer.active_adapters if a in layer.lora_A]
        merged[f"{key}.base_layer.weight"] = merged_weight(state[f"{key}.base_layer.weight"], scaled)
    return {k.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): v
            for k, v in merged.items() if ".lora_" not in k}


def save_merged(forward: torch.nn.Module, model, directory: Path, dp: DataParallel, dtype: torch.dtype,
                prefix: str = "policy.") -> None:
    """Rank 0 writes the merged model in ``dtype`` as an HF checkpoint (``AutoModelForCausalLM``
    loads it), from ``forward``'s shards gathered tensor by tensor into its host memory (as the
    full-model export, distributed/checkpoint.py); the trainer's adapters stay unmerged."""
    full = get_model_state_dict(forward, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dp.is_main:
        return
    state = merged_state(model, {k.removeprefix(prefix): v for k, v in full.items()})
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.get_base_model().save_pretrained(str(directory), state_dict=state, safe_serialization=True)
