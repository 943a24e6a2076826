"""Sharding a role's model with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Units (one all-gather and one reduce-scatter each): every decoder layer; the input embedding
when it is not tied to the LM head; the root (the module the trainer calls: final norm, LM
head, and the tied embedding, which must stay in one unit with the head it shares its weight
with, ``../shared/reference/SCALE.md`` §1.3).

Precision: the sharded parameters are the fp32 master copy (``master_dtype``), the optimizer
steps on them; each unit's forward gathers them cast to the compute dtype (``model.dtype``)
and gradients are reduced in fp32 (``MixedPrecisionPolicy``). Frozen parameters
(``requires_grad=False``: a LoRA model's base) are sharded in the compute dtype: no optimizer
steps on them, so a master copy would only double their memory (FSDP2 asks a uniform original
dtype of the trainable parameters of a unit only). Gradients are *summed* over
ranks (divide factor 1, forced sum: gloo has no PREMUL_SUM): each rank's loss is already its
share of the global loss (global token / sequence counts), so the sum is the exact gradient.

Initialisation: only rank 0 needs real weights; other ranks may build the model on the meta
device. Rank 0's full state is broadcast into every rank's shards
(``set_model_state_dict(broadcast_from_rank0=True)``), then the buffers FSDP does not manage
(rotary ``inv_freq``, non-persistent) in sorted-name order.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from asyncrl.distributed.group import DataParallel


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model: modules whose class is in ``_no_split_modules``
    (the layers HF itself never splits across devices), in module order."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no _no_split_modules)")
    return layers


def _untied_input_embedding(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    hf = next((m for m in model.modules() if hasattr(m, "get_input_embeddings")), None)
    if hf is None:
        return None
    embed = hf.get_input_embeddings()
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    return embed if head is None or head.weight is not embed.weight else None


def precision_policy(compute_dtype: torch.dtype, master_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Gather in the compute dtype, keep the master dtype in the shards, reduce in fp32."""
    if compute_dtype == master_dtype:
        return MixedPrecisionPolicy(reduce_dtype=torch.float32 if master_dtype != torch.float64 else None)
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard_model(root: torch.nn.Module, dp: DataParallel, *, compute_dtype: torch.dtype,
                master_dtype: torch.dtype = torch.float32, offload_params: bool = False) -> torch.nn.Module:
    """Shard ``root`` in place over ``dp.mesh`` (see module doc) and return it.

    Rank 0's ``root`` must hold the real weights; on other ranks it may be on the meta device.
    ``offload_params``: parameters, gradients and optimizer state live in host memory
    (``CPUOffloadPolicy``), gathered to the GPU per unit."""
    _cast_for_sharding(root, master_dtype, compute_dtype)
    full = _full_state(root) if dp.world_size > 1 and dp.is_main else {}
    mp = precision_policy(compute_dtype, master_dtype)
    offload = CPUOffloadPolicy(pin_memory=dp.device.type == "cuda") if offload_params else OffloadPolicy()
    units = decoder_layers(root)
    embed = _untied_input_embedding(root)
    if embed is not None:
        units.append(embed)
    for unit in [*units, root]:
        fully_shard(unit, mesh=dp.mesh, mp_policy=mp, offload_policy=offload)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    if any(p.is_meta for p in root.parameters()) or any(b.is_meta for b in root.buffers()):
        root.to_empty(device="cpu" if offload_params else dp.device)
        for module in root.modules():  # buffers are not FSDP's: they live on the compute device
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.to(dp.device)
    if dp.world_size > 1:
        set_model_state_dict(root, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for _, buffer in sorted(root.named_buffers(), key=lambda item: item[0]):
            dist.broadcast(buffer.data, src=0)
    return root


def _cast_for_sharding(root: torch.nn.Module, master_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Trained parameters and buffers in the master dtype, frozen parameters in the compute
    dtype (in place; meta tensors stay meta)."""
    root.to(master_dtype)
    for param in root.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(compute_dtype)


def _full_state(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's unsharded weights in the dtypes of the shards they fill, on the CPU (the
    broadcast source)."""
    return {k: v.detach().to("cpu") for k, v in root.state_dict().items()}


def fsdp_units(root: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 units under ``root``, in module order (layers first, the root last)."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    return [*units[1:], units[0]] if units and units[0] is root else units


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)
