"""FP8 rollout: the engine's linear layers with e4m3 weights, quantized on arrival.

``LLM(..., quantization="fp8")`` / ``rollout.quantization: fp8`` swaps every linear of the decoder
layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) for an :class:`Fp8Linear` before
the weights are loaded; embeddings, the LM head and the norms stay in the engine's dtype (the
DeepSeek-V3 / slime / verl skip list, SCALE.md §4.4). Every tensor that reaches a linear -- the
checkpoint at start-up, then each ``update_weights`` from the bf16 trainer -- is sliced for this
rank as the plain layer slices it (``local_part``, engine/parallel/layers.py) and quantized in
place into the stored e4m3 weight and its scales; nothing of the bf16 copy is kept, so a weight
sync re-quantizes every time, and CUDA graphs captured over the storages replay the new values.

Two scalings (``fp8_scaling``, the names of compressed-tensors' weight strategies):
  ``block``    128 x 128 weight blocks, activations per token per 128 channels (DeepSeek-V3, vLLM's
               ``weight_block_size: [128, 128]``, llm-compressor's FP8_BLOCK); cuBLAS's blockwise
               ``F.scaled_mm`` (``fp8.py``). The default.
  ``channel``  one scale per output channel, activations per token (llm-compressor's FP8_DYNAMIC,
               what vLLM serves with CUTLASS on Hopper); ``torch._scaled_mm`` rowwise (``fp8_channel.py``)

Fused layers: each HF shard (q | k | v, gate | up) is quantized on its own, so (``block``) its rows
start on a 128-row block and a block never mixes two shards (a shard arrives alone during a sync; a
block shared with another shard could not be re-quantized without it); ``channel`` scales are per
row, so shards sit back to back and only the total is padded to 16 rows. When a shard's row count
is not a multiple of the alignment (small test models) the stored weight has zero padding rows and
the output columns are gathered back (``keep``); real models (head_dim 128, intermediate % 128 == 0)
have none.

Refused by name: families other than the dense decoder (MoE experts, Gated DeltaNet), and LoRA
(served on the fly its base GEMM would need the bf16 weight; merged, the merge would run on FP8).
Work with it: tensor parallelism (each rank quantizes its slice), CUDA graphs, speculative decoding
(the verify step runs the same layers; a draft model stays in the engine's dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional

import torch
from torch import nn

from asyncrl.engine import fp8, fp8_channel
from asyncrl.engine.fp8 import FP8, check_fp8_device, padded
from asyncrl.engine.parallel.layers import MergedColumnParallelLinear, RowParallelLinear

QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class Fp8Scaling:
    """How one FP8 recipe stores a weight ``[R, K]``: ``quantize(w, Kp) -> (q [R', Kp], scale)`` with one
    scale row per ``row_block`` weight rows and ``scale_cols(Kp)`` scale columns; ``matmul(x, q,
    scale) -> [M, R']`` (the fast path on CUDA bf16, the reference elsewhere)."""
    name: str
    row_block: int                       # weight rows that share a row of scales
    shard_align: int                     # a fused shard's first row is a multiple of this
    rows_align: int                      # the stored rows are a multiple of this
    padded_k: Callable[[int], int]
    scale_cols: Callable[[int], int]
    quantize: Callable
    dequantize: Callable
    matmul: Callable


SCALINGS = {
    "block": Fp8Scaling("block", fp8.BLOCK, fp8.BLOCK, fp8.BLOCK, fp8.padded_k, lambda kp: kp // fp8.BLOCK,
                        fp8.quantize_weight, fp8.dequantize_weight, fp8.fp8_matmul),
    "channel": Fp8Scaling("channel", 1, 1, fp8_channel.K_ALIGN, fp8_channel.padded_k, lambda kp: 1,
                          fp8_channel.quantize_rows, fp8_channel.dequantize_rows, fp8_channel.fp8_matmul),
}


class Fp8Linear(nn.Module):
    """``forward(x [..., in]) -> [..., out]`` = ``x Wᵀ + b`` with W stored in e4m3 and scaled by ``scaling``.

    ``weight [Np, Kp]`` e4m3 (a Parameter, so ``load_weights`` finds it under the same name) and
    ``weight_scale_inv`` fp32 (``block``: ``[Np/128, Kp/128]``; ``channel``: ``[Np, 1]``); shard i's rows
    start at ``starts[i]`` (a multiple of ``scaling.shard_align``). ``bias`` (if any) stays in the
    engine's dtype. Under tensor parallelism the layer keeps the plain layer's split: a row-parallel
    layer all-reduces, its bias added by rank 0 only.

    Invariant: ``weight`` and ``weight_scale_inv`` are allocated once and only written in place,
    one whole shard at a time, each shard quantized from its own full-precision rows."""

    def __init__(self, base: nn.Linear, scaling: str = "block"):
        super().__init__()
        check_fp8_scaling(scaling)
        self.scaling = SCALINGS[scaling]
        device = base.weight.device
        self.in_features, self.out_features = base.in_features, base.out_features
        self.shard_rows = _shard_rows(base)                      # shard key -> (local offset, rows)
        self.starts, start = {}, 0
        for key, (_, rows) in self.shard_rows.items():
            self.starts[key] = start
            start += padded(rows, self.scaling.shard_align)
        start = padded(start, self.scaling.rows_align)
        k_padded = self.scaling.padded_k(self.in_features)
        self.weight = nn.Parameter(torch.zeros(start, k_padded, dtype=FP8, device=device), requires_grad=False)
        scale_shape = (start // self.scaling.row_block, self.scaling.scale_cols(k_padded))
        self.register_buffer("weight_scale_inv", torch.ones(scale_shape, dtype=torch.float32, device=device),
                             persistent=False)
        self.bias = base.bias
        keep = torch.cat([torch.arange(rows) + self.starts[key] for key, (_, rows) in self.shard_rows.items()])
        # output columns to keep: None when they are the first out_features (no padding, or padding
        # rows at the end only: sliced off, cheaper than a gather)
        prefix = torch.equal(keep, torch.arange(self.out_features))
        self.register_buffer("keep", None if prefix else keep.to(device), persistent=False)
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
        y = self.scaling.matmul(flat, self.weight, self.weight_scale_inv)
        if self.keep is not None:
            y = y.index_select(1, self.keep)
        elif y.shape[1] != self.out_features:
            y = y[:, :self.out_features].contiguous()
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
        q, scale = self.scaling.quantize(rows.to(self.weight.device), self.weight.shape[1])
        first, block = self.starts[shard], self.scaling.row_block
        self.weight.data[first:first + q.shape[0]].copy_(q)
        self.weight_scale_inv[first // block:(first + q.shape[0]) // block].copy_(scale)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, fp32 ``[out, in]`` (what the tests compare with)."""
        full = self.scaling.dequantize(self.weight, self.weight_scale_inv)[:, :self.in_features]
        return full[:self.out_features] if self.keep is None else full[self.keep]


def _shard_rows(base: nn.Linear) -> dict:
    """Shard key -> (first local output row, rows) of the HF tensors the layer fuses (one for a plain
    column / row layer, keyed ``None`` as ``load_weights`` passes it)."""
    if isinstance(base, MergedColumnParallelLinear):
        return {key: (offset, local) for key, (offset, _, local, _) in base.shards.items()}
    return {None: (0, base.out_features)}


def check_quantization(quantization: Optional[str]) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: the engine knows {QUANTIZATIONS[1:]} (or None)")


def check_fp8_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"fp8_scaling={scaling!r}: the engine knows {tuple(SCALINGS)}")


def quantize_linears(model: nn.Module, quantization: Optional[str], scaling: str = "block") -> int:
    """Swap the decoder layers' linears of ``model`` (built, not yet filled) for :class:`Fp8Linear`
    with ``scaling`` (:data:`SCALINGS`); returns how many. ``None``: nothing. A family other than the
    dense decoder is refused by name."""
    check_quantization(quantization)
    check_fp8_scaling(scaling)
    if quantization is None:
        return 0
    from asyncrl.engine.models.decoder import DecoderModel

    if type(model.model) is not DecoderModel:
        raise ValueError(f"quantization='fp8' covers the dense decoder (Qwen3 / Qwen2 / Llama / Mistral); "
                         f"{model.config.architecture} has its own layers (MoE experts or Gated DeltaNet) that "
                         "are not quantized yet: leave rollout.quantization unset for it")
    linears = [(name, module) for name, module in model.model.layers.named_modules() if isinstance(module, nn.Linear)]
    check_fp8_device(linears[0][1].weight.device, f"quantization='fp8' ({scaling}-scaled FP8 GEMMs)", (9, 0))
    for name, module in linears:
        parent, _, leaf = name.rpartition(".")
        setattr(model.model.layers.get_submodule(parent), leaf, Fp8Linear(module, scaling))
    return len(linears)
