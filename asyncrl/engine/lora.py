"""LoRA in the engine: the base weights held once, the adapter applied on the fly.

An adapted linear computes ``y = x·Wᵀ + b + (x·Aᵀ)·(s·B)ᵀ`` (Hu et al. 2021; PEFT's
``base(x) + lora_B(lora_A(x)) * scaling``) with two more GEMMs over the step's packed tokens:
``x [T, in] · Aᵀ [in, R]`` (shrink) then ``[T, R] · Bᵀ [R, out]`` added into the base output
(``addmm``, expand). The engine fuses projections (``qkv_proj`` = q|k|v, ``gate_up_proj`` =
gate|up): their adapters are stacked, ``A = [A_q; A_k; A_v]`` ``[Σr, in]``, and ``B`` is block
diagonal ``[out, Σr]`` (shard i's rows x shard i's rank columns, zeros elsewhere), so one
shrink and one expand serve the whole fused layer. The scale is folded into the stored ``B``.

The storages of A and B are allocated once, when the adapter is installed, and every update
writes them with ``copy_``: CUDA graphs captured over them replay with the new values, and a
weight sync moves A and B only (``LLM.update_weights`` routes ``lora_A``/``lora_B`` names here).

Names follow PEFT, whose files and modules this reads without importing it:
``base_model.model.<HF module>.lora_A[.<adapter>].weight`` (``[r, in]``) and ``lora_B`` (``[out, r]``),
``<HF module>.base_layer.weight`` for the frozen base, ``adapter_config.json`` for r and alpha.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

PEFT_PREFIX = "base_model.model."
_LORA_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")


def parse_lora_name(name: str) -> Optional[tuple[str, str]]:
    """(HF module name, "A" | "B") of a PEFT adapter tensor name, or None for any other tensor."""
    if ".lora_" not in name:  # every base tensor of every weight sync: no regex for them
        return None
    match = _LORA_NAME.match(name)
    return (match["module"], match["kind"]) if match else None


def base_name(name: str) -> str:
    """The HF name of a tensor named the PEFT way (``base_model.model.`` prefix, ``.base_layer.``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def base_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors under their HF names (adapter tensors left out)."""
    for name, tensor in named_tensors:
        if parse_lora_name(name) is None:
            yield base_name(name), tensor


def is_peft_module(model) -> bool:
    """A PEFT ``PeftModel`` (duck-typed: the engine does not import peft)."""
    return isinstance(model, nn.Module) and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@dataclass(frozen=True)
class AdapterShape:
    """One adapted HF linear: its rank r and scale s (alpha / r, or alpha / sqrt(r) with rsLoRA)."""
    rank: int
    scale: float


def peft_module_adapter(model) -> tuple[dict[str, AdapterShape], list[tuple[str, torch.Tensor]]]:
    """(HF module -> shape, adapter tensors) of a PEFT model's active adapter, read off its layers."""
    shapes: dict[str, AdapterShape] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if len(active) > 1:
            raise ValueError(f"{name}: {len(active)} active LoRA adapters; the engine serves one at a time")
        if active:
            shapes[name.removeprefix(PEFT_PREFIX)] = AdapterShape(module.r[active[0]], float(module.scaling[active[0]]))
    tensors = [(n, p) for n, p in model.state_dict().items() if parse_lora_name(n) is not None]
    return shapes, tensors


def read_adapter_dir(path: str) -> tuple[dict[str, AdapterShape], list[tuple[str, torch.Tensor]]]:
    """(HF module -> shape, adapter tensors) of a PEFT adapter directory (``save_pretrained``'s
    ``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(f"{path}: not a PEFT adapter directory (adapter_config.json + "
                                "adapter_model.safetensors)")
    config = json.loads(open(config_path).read())
    if config.get("peft_type", "LORA") != "LORA" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: the engine serves plain LoRA adapters (one r and alpha for every layer)")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    tensors = list(load_file(weights_path).items())
    modules = {parse_lora_name(n)[0] for n, _ in tensors if parse_lora_name(n) is not None}
    return {base_name(m): AdapterShape(rank, scale) for m in modules}, tensors


class LoRALinear(nn.Module):
    """A base linear plus stacked adapters: ``forward(x [..., in]) -> [..., out]``.

    Keeps the base's ``weight`` / ``bias`` Parameters under the same names (checkpoint loading
    and weight updates find them where they were). ``lora_a [Σr, in]`` holds the shards' A
    stacked, ``lora_b [out, Σr]`` their scaled B block-diagonally; shard i covers output rows
    ``rows[i]`` and rank columns ``cols[i]``.

    Invariant: ``lora_a`` and ``lora_b`` are never reallocated, only written in place."""

    def __init__(self, base: nn.Linear, shards: list[tuple[int, int, int]]):
        """``shards``: (first output row, end row, rank) of each adapted slice of the output."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # a (fused, maybe parallel) base layer's own loader keeps slicing checkpoint / merged
        # tensors into ``weight`` (the same Parameter): not a submodule, so no duplicate names
        self._base_loader = getattr(base, "weight_loader", None)
        total = sum(rank for _, _, rank in shards)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_a", torch.zeros(total, self.in_features, **like), persistent=False)
        self.register_buffer("lora_b", torch.zeros(self.out_features, total, **like), persistent=False)
        self.rows, self.cols, start = [], [], 0
        for first, end, rank in shards:
            self.rows.append((first, end))
            self.cols.append((start, start + rank))
            start += rank

    def __getattr__(self, name: str):
        if name == "weight_loader":  # load_weights looks it up with getattr(module, "weight_loader", None)
            loader = self.__dict__.get("_base_loader")
            if loader is None:
                raise AttributeError(name)
            return loader
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        shrunk = F.linear(x, self.lora_a)  # [..., Σr]
        flat = torch.addmm(out.reshape(-1, self.out_features), shrunk.reshape(-1, shrunk.shape[-1]), self.lora_b.t())
        return flat.view(out.shape)

    @torch.no_grad()
    def load(self, shard: int, kind: str, tensor: torch.Tensor, scale: float) -> None:
        """Write shard ``shard``'s A (``[r, in]``) or B (``[rows, r]``, scaled here) in place."""
        (r0, r1), (c0, c1) = self.rows[shard], self.cols[shard]
        if kind == "A":
            dst, value = self.lora_a[c0:c1], tensor
        else:
            dst, value = self.lora_b[r0:r1, c0:c1], tensor.float() * scale
        if dst.shape != tensor.shape:
            raise ValueError(f"LoRA {kind} of shape {tuple(tensor.shape)} where the engine holds {tuple(dst.shape)} "
                             "(another rank or model than the engine was built with?)")
        dst.copy_(value.to(device=dst.device, dtype=dst.dtype))


def engine_rows(model: nn.Module, weight_name: str) -> tuple[str, int, int]:
    """(engine parameter, first row, end row) that the HF weight ``weight_name`` fills, by the
    model family's own loading map (fused q|k|v and gate|up, Qwen3.5's names and layouts)."""
    from asyncrl.engine.models.decoder import _PACKED

    name = model._local_name(weight_name) if hasattr(model, "_local_name") else weight_name
    if name is None:
        raise KeyError(f"no engine layer for LoRA on {weight_name!r}")
    if hasattr(model, "_fused_rows") and name.startswith("model.layers."):
        fused = model._fused_rows(name)
        if fused is not None:
            return fused
    for frag, (fused_name, shard) in _PACKED.items():
        if f".{frag}." in name:
            fused = name.replace(f".{frag}.", f".{fused_name}.")
            try:  # a fused layer (MergedColumnParallelLinear, QKVParallelLinear) lists its shards' rows
                shards = model.get_submodule(fused.rpartition(".")[0]).shards
            except AttributeError:
                break
            offset, _, local, _ = shards[shard]  # LoRA is served at tensor_parallel_size=1: local == full
            return fused, offset, offset + local
    params = dict(model.named_parameters())
    if name not in params:
        raise KeyError(f"no engine layer for LoRA on {weight_name!r}")
    return name, 0, params[name].shape[0]


class EngineLoRA:
    """The adapter slots installed in an engine model (one adapter, served unmerged).

    Invariant: every HF module of ``shapes`` maps to one shard of one :class:`LoRALinear`, whose
    storages the CUDA graphs read; ``load`` only copies into them."""

    def __init__(self, model: nn.Module, shapes: dict[str, AdapterShape]):
        self.shapes = dict(shapes)
        by_layer: dict[str, list[tuple[int, int, str]]] = {}
        for module in sorted(shapes):
            param, first, end = engine_rows(model, f"{module}.weight")
            by_layer.setdefault(param.removesuffix(".weight"), []).append((first, end, module))
        self.slots: dict[str, tuple[LoRALinear, int]] = {}
        for path, shards in by_layer.items():
            base = model.get_submodule(path)
            if not isinstance(base, nn.Linear):  # plain, or a fused/parallel linear at tensor_parallel_size=1
                raise ValueError(f"LoRA on {shards[0][2]}: the engine's {path} is not a linear layer "
                                 "(adapters on linear projections only; rollout.backend=hf serves others)")
            shards.sort()
            layer = LoRALinear(base, [(first, end, shapes[module].rank) for first, end, module in shards])
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, layer)
            for index, (_, _, module) in enumerate(shards):
                self.slots[module] = (layer, index)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy PEFT-named adapter tensors into their slots; returns how many. Unknown modules raise."""
        n = 0
        for name, tensor in named_tensors:
            module, kind = parse_lora_name(name)
            module = base_name(module)
            if module not in self.slots:
                raise KeyError(f"LoRA tensor {name!r}: the engine holds no adapter for {module} "
                               f"(it was built for {len(self.slots)} adapted layers)")
            layer, shard = self.slots[module]
            layer.load(shard, kind, tensor, self.shapes[module].scale)
            n += 1
        return n

    @property
    def num_tensors(self) -> int:
        return 2 * len(self.slots)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the slots hold A and B in (the base weights'): what a push should send."""
        layer, _ = next(iter(self.slots.values()))
        return layer.lora_a.dtype


@torch.no_grad()
def merge_adapter(model: nn.Module, shapes: dict[str, AdapterShape],
                  named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Add s·B·A into the base weights of ``model`` in place (the product in fp32): the engine
    then serves the merged model with plain GEMMs."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        module, kind = parse_lora_name(name)
        pairs.setdefault(base_name(module), {})[kind] = tensor
    params = dict(model.named_parameters())
    for module, ab in pairs.items():
        param, first, end = engine_rows(model, f"{module}.weight")
        rows = params[param].data[first:end]
        delta = shapes[module].scale * (ab["B"].float() @ ab["A"].float()).to(rows.device)
        rows.copy_((rows.float() + delta).to(rows.dtype))


def split_update(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, list]:
    """(base tensors under HF names, adapter tensors) of a weight update."""
    base, adapters = [], []
    for name, tensor in named_tensors:
        if parse_lora_name(name) is None:
            base.append((base_name(name), tensor))
        else:
            adapters.append((name, tensor))
    return base, adapters


def attach_adapter(model: nn.Module, source, adapter_dir: Optional[str], merge: bool) -> Optional[EngineLoRA]:
    """Serve the adapter of ``source`` (a PEFT module) or of ``adapter_dir`` (a PEFT adapter
    directory) in the engine ``model`` built from its base: installed in slots and loaded
    (returned), or merged into the weights (``merge``; returns None). No adapter: None."""
    if adapter_dir is not None:
        shapes, tensors = read_adapter_dir(adapter_dir)
    elif is_peft_module(source):
        shapes, tensors = peft_module_adapter(source)
    else:
        return None
    if not shapes:
        return None
    if merge:
        merge_adapter(model, shapes, tensors)
        return None
    slots = EngineLoRA(model, shapes)
    slots.load(tensors)
    return slots


def _refuse_adapters(named_tensors: Iterable[tuple[str, torch.Tensor]], merged: bool):
    """The tensors under base names, one at a time; an adapter tensor raises, naming why."""
    for name, tensor in named_tensors:
        if parse_lora_name(name) is not None:
            why = ("serves its adapter merged (merge_lora=True): send the merged weights W + s·B·A"
                   if merged else "was built without a LoRA adapter (build it from a PEFT model or with lora=DIR)")
            raise ValueError(f"LoRA tensor {name!r} sent to an engine that {why}")
        yield base_name(name), tensor


def load_update(model: nn.Module, slots: Optional[EngineLoRA], named_tensors: Iterable[tuple[str, torch.Tensor]],
                merged: bool) -> None:
    """A weight update: base tensors (HF or PEFT names) into the weights, adapter tensors into
    the slots. An adapter for an engine without slots is refused, naming why.

    Without slots the tensors are loaded as they stream (not collected first): the sharded
    trainer's push yields views of a reused bucket, valid only until the next one arrives."""
    if slots is None:
        model.load_weights(_refuse_adapters(named_tensors, merged))
        return
    base, adapters = split_update(named_tensors)
    if base:
        model.load_weights(base)
    if adapters:
        slots.load(adapters)
