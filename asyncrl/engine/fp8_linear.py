"""FP8 rollout: the engine's linear layers with blockwise e4m3 weights, quantized on arrival.

``LLM(..., quantization="fp8")`` / ``rollout.quantization: fp8`` swaps every linear of the decoder
layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) for an :class:`Fp8Linear` before
the weights are loaded; embeddings, the LM head and the norms stay in the engine's dtype (the
DeepSeek-V3 / slime / verl skip list, SCALE.md §4.4). Every tensor that reaches a linear -- the
checkpoint at start-up, then each ``update_weights`` from the bf16 trainer -- is sliced for this
rank as the plain layer slices it (``local_part``, engine/parallel/layers.py) and quantized in
place into the stored e4m3 weight and its scales; nothing of the bf16 copy is kept, so a weight
sync re-quantizes every time, and CUDA graphs captured over the storages replay the new values.

Fused layers: each HF shard (q | k | v, gate | up) is quantized on its own, so its rows start on a
128-row block and a block never mixes two shards (a shard arrives alone during a sync; a block
shared with another shard could not be re-quantized without it). When a shard's row count is not
a multiple of 128 (small test models) the stored weight has zero padding rows after it and the
output columns are gathered back (``keep``); real models (head_dim 128, intermediate % 128 == 0)
have none.

Refused by name: families other than the dense decoder (MoE experts, Gated DeltaNet), and LoRA
(served on the fly its base GEMM would need the bf16 weight; merged, the merge would run on FP8).
Work with it: tensor parallelism (each rank quantizes its slice), CUDA graphs, speculative decoding
(the verify step runs the same layers; a draft model stays in the engine's dtype).
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import nn

from asyncrl.engine.fp8 import BLOCK, FP8, check_fp8_device, fp8_matmul, padded, padded_k, quantize_weight
from asyncrl.engine.parallel.layers import MergedColumnParallelLinear, RowParallelLinear

QUANTIZATIONS = (None, "fp8")


class Fp8Linear(nn.Module):
    """``forward(x [..., in]) -> [..., out]`` = ``x Wᵀ + b`` with W stored as e4m3 blocks.

    ``weight [Np, Kp]`` e4m3 (a Parameter, so ``load_weights`` finds it under the same name) and
    ``weight_scale_inv [Np/128, Kp/128]`` fp32; shard i's rows start at ``starts[i]`` (a multiple of
    128). ``bias`` (if any) stays in the engine's dtype. Under tensor parallelism the layer keeps
    the plain layer's split: a row-parallel layer all-reduces, its bias added by rank 0 only.

    Invariant: ``weight`` and ``weight_scale_inv`` are allocated once and only written in place,
    one whole shard at a time, each shard quantized from its own full-precision rows."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        device = base.weight.device
        self.in_features, self.out_features = base.in_features, base.out_features
        self.shard_rows = _shard_rows(base)                      # shard key -> (local offset, rows)
        self.starts, start = {}, 0
        for key, (_, rows) in self.shard_rows.items():
            self.starts[key] = start
            start += padded(rows, BLOCK)
        k_padded = padded_k(self.in_features)
        self.weight = nn.Parameter(torch.zeros(start, k_padded, dtype=FP8, device=device), requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.ones(start // BLOCK, k_padded // BLOCK, device=device),
                             persistent=False)
        self.bias = base.bias
        keep = torch.cat([torch.arange(rows) + self.starts[key] for key, (_, rows) in self.shard_rows.items()])
        # output columns to keep (None: no padding rows, the GEMM's output is the layer's)
        self.register_buffer("keep", None if start == self.out_features else keep.to(device), persistent=False)
        tp = getattr(base, "tp", None)
        # a row-parallel layer split over ranks: its partial outputs are all-reduced over ``tp.comm``
        self.reduce = tp if isinstance(base, RowParallelLinear) and tp.size > 1 else None
        self.adds_bias = self.bias is not None and (self.reduce is None or tp.rank == 0)
        # the plain layer slices each full HF tensor for this rank (``local_part``); it keeps its
        # weight's shape only (a meta tensor), so the full-precision copy is freed
        base.weight = nn.Parameter(torch.empty(base.weight.shape, device="meta"), requires_grad=False)
        self._base = [base]  # a list: not a submodule (its parameters are this layer's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = fp8_matmul(flat, self.weight, self.weight_scale_inv)
        if self.keep is not None:
            y = y.index_select(1, self.keep)
        if self.adds_bias:
            y = y + self.bias
        if self.reduce is not None:
            y = self.reduce.comm.all_reduce(y)
        return y.view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                      name: str = "") -> None:
        """A full HF tensor: the bias copied, the weight's shard quantized into its rows (in place)."""
        base = self._base[0]
        if param_name == "bias":
            return base.weight_loader(param_name, loaded, shard, name)
        _, rows = base.local_part(param_name, loaded, shard, name)
        q, scale = quantize_weight(rows.to(self.weight.device), self.weight.shape[1])
        first = self.starts[shard]
        self.weight.data[first:first + q.shape[0]].copy_(q)
        self.weight_scale_inv[first // BLOCK:(first + q.shape[0]) // BLOCK].copy_(scale)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, fp32 ``[out, in]`` (what the tests compare with)."""
        from asyncrl.engine.fp8 import dequantize_weight

        full = dequantize_weight(self.weight, self.weight_scale_inv)[:, :self.in_features]
        return full if self.keep is None else full[self.keep]


def _shard_rows(base: nn.Linear) -> dict:
    """Shard key -> (first local output row, rows) of the HF tensors the layer fuses (one for a plain
    column / row layer, keyed ``None`` as ``load_weights`` passes it)."""
    if isinstance(base, MergedColumnParallelLinear):
        return {key: (offset, local) for key, (offset, _, local, _) in base.shards.items()}
    return {None: (0, base.out_features)}


def check_quantization(quantization: Optional[str]) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: the engine knows {QUANTIZATIONS[1:]} (or None)")


def quantize_linears(model: nn.Module, quantization: Optional[str]) -> int:
    """Swap the decoder layers' linears of ``model`` (built, not yet filled) for :class:`Fp8Linear`;
    returns how many. ``None``: nothing. A family other than the dense decoder is refused by name."""
    check_quantization(quantization)
    if quantization is None:
        return 0
    from asyncrl.engine.models.decoder import DecoderModel

    if type(model.model) is not DecoderModel:
        raise ValueError(f"quantization='fp8' covers the dense decoder (Qwen3 / Qwen2 / Llama / Mistral); "
                         f"{model.config.architecture} has its own layers (MoE experts or Gated DeltaNet) that "
                         "are not quantized yet: leave rollout.quantization unset for it")
    linears = [(name, module) for name, module in model.model.layers.named_modules() if isinstance(module, nn.Linear)]
    check_fp8_device(linears[0][1].weight.device, "quantization='fp8' (blockwise-scaled FP8 GEMMs)", (9, 0))
    for name, module in linears:
        parent, _, leaf = name.rpartition(".")
        setattr(model.model.layers.get_submodule(parent), leaf, Fp8Linear(module))
    return len(linears)
