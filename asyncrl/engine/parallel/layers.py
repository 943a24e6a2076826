"""Tensor-parallel layers (Megatron's split, nano-vllm/vLLM's names) with loaders that take
FULL Hugging Face tensors and keep this rank's slice: one weight format serves every TP size
(``load_weights`` at build and at each weight sync alike).

    ColumnParallelLinear        W [out, in] split by output rows; output stays split
    MergedColumnParallelLinear  several HF outputs in one GEMM (gate|up), each split by rows
    QKVParallelLinear           q|k|v by heads; KV heads replicated when fewer than ranks
    RowParallelLinear           W split by input columns; partial outputs all-reduced
    VocabParallelEmbedding      vocabulary rows split; ids of other shards give zeros; all-reduced
    ParallelLMHead              vocabulary rows split; logits stay split (the sampler gathers them)

With ``tp.size == 1`` every class is its plain torch layer: the column layers inherit
``nn.Linear.forward``; the row, vocab and head layers call the same single ``F.linear`` /
``F.embedding`` after one integer test, so a TP=1 engine launches exactly the kernels it did
before (and CUDA graphs replay decode without any Python at all).

Loading: a module's ``weight_loader(param_name, full_tensor, shard, name)`` copies its slice in place (the
parameter's storage, and any CUDA graph captured over it, stays valid); a shape that is not
the full HF shape raises ``ValueError``. ``local_part`` says which slice and where it goes, so a
layer that stores its weight differently (FP8, ``engine/fp8_linear.py``) slices the same way.
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engine.parallel.layout import SINGLE, TensorParallel


def _check_shape(loaded: torch.Tensor, full_shape: tuple, name: str) -> None:
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(f"{name}: shape {tuple(loaded.shape)} != {tuple(full_shape)}")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def _copy_rows(param: torch.Tensor, first: int, src: torch.Tensor) -> None:
    """``src`` into rows ``[first, first + len(src))`` of ``param``."""
    _copy(param if first == 0 and src.shape[0] == param.shape[0] else param[first:first + src.shape[0]], src)


def _rows(loaded: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``loaded`` (itself when that is all of it: TP = 1)."""
    return loaded if start == 0 and length == loaded.shape[0] else loaded.narrow(0, start, length)


def load_replicated(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """A parameter every rank holds whole (norms, biases of row-parallel layers)."""
    _check_shape(loaded, param.shape, name)
    _copy(param.data, loaded)


class ColumnParallelLinear(nn.Linear):
    """``y = x Wᵀ + b`` with W's rows (outputs) split: weight ``[out / tp, in]``, bias
    ``[out / tp]``; rank r holds rows ``[r·out/tp, (r+1)·out/tp)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__(in_features, out_features // tp.size, bias=bias)
        self.tp = tp

    def local_part(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                   name: str = "") -> tuple[int, torch.Tensor]:
        """(first local row, this rank's slice of the full HF tensor ``loaded``) of ``param_name``."""
        param = getattr(self, param_name)
        rows = param.shape[0]
        _check_shape(loaded, (rows * self.tp.size, *param.shape[1:]), name)
        return 0, _rows(loaded, self.tp.rank * rows, rows)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                      name: str = "") -> None:
        _copy_rows(getattr(self, param_name).data, *self.local_part(param_name, loaded, shard, name))


class MergedColumnParallelLinear(nn.Linear):
    """Several column-parallel outputs fused into one GEMM. ``shards[id] = (full_rows,
    local_rows, src_start)``: HF tensor ``id`` has ``full_rows`` rows, of which this rank
    keeps ``[src_start, src_start + local_rows)``, stored after the shards listed before it."""

    def __init__(self, in_features: int, shards: dict[Hashable, tuple[int, int, int]], bias: bool = False,
                 tp: TensorParallel = SINGLE):
        super().__init__(in_features, sum(local for _, local, _ in shards.values()), bias=bias)
        self.tp = tp
        self.shards, offset = {}, 0
        for key, (full, local, start) in shards.items():
            self.shards[key] = (offset, full, local, start)
            offset += local

    @classmethod
    def gate_up(cls, in_features: int, intermediate: int, tp: TensorParallel = SINGLE) -> "MergedColumnParallelLinear":
        """SwiGLU's gate (shard 0) and up (shard 1) projections, each split by rows."""
        local = intermediate // tp.size
        return cls(in_features, {0: (intermediate, local, tp.rank * local), 1: (intermediate, local, tp.rank * local)},
                   tp=tp)

    def local_part(self, param_name: str, loaded: torch.Tensor, shard: Hashable,
                   name: str = "") -> tuple[int, torch.Tensor]:
        """(first local row of shard ``shard``, this rank's rows of the full HF tensor ``loaded``)."""
        offset, full, local, start = self.shards[shard]
        _check_shape(loaded, (full, *getattr(self, param_name).shape[1:]), name)
        return offset, _rows(loaded, start, local)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Hashable, name: str = "") -> None:
        _copy_rows(getattr(self, param_name).data, *self.local_part(param_name, loaded, shard, name))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q | k | v projections by heads: this rank's ``H/tp`` query heads and ``max(1, Hkv/tp)``
    KV heads (with ``tp > Hkv`` each KV head is replicated on ``tp/Hkv`` ranks: the one its
    query heads attend with)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel = SINGLE):
        q, kv = tp.heads(num_heads) * head_dim, tp.kv_heads(num_kv_heads) * head_dim
        q_start, kv_start = tp.rank * q, tp.kv_head_start(num_kv_heads) * head_dim
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, {"q": (full_q, q, q_start), "k": (full_kv, kv, kv_start),
                                  "v": (full_kv, kv, kv_start)}, bias=bias, tp=tp)


class RowParallelLinear(nn.Linear):
    """``y = Σ_ranks x_r W_rᵀ + b``: weight ``[out, in / tp]`` (columns split), input split the
    same way (a column-parallel layer's output); one all-reduce; bias added by rank 0 only."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.comm.all_reduce(y)

    def local_part(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                   name: str = "") -> tuple[int, torch.Tensor]:
        """(0, this rank's columns of the full HF weight ``loaded``; the whole bias: replicated)."""
        param = getattr(self, param_name)
        if param_name == "bias":
            _check_shape(loaded, param.shape, name)
            return 0, loaded
        cols = param.shape[1]
        _check_shape(loaded, (param.shape[0], cols * self.tp.size), name)
        return 0, loaded if self.tp.size == 1 else loaded.narrow(1, self.tp.rank * cols, cols)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                      name: str = "") -> None:
        _copy_rows(getattr(self, param_name).data, *self.local_part(param_name, loaded, shard, name))


def _load_vocab_rows(param: torch.Tensor, loaded: torch.Tensor, vocab: int, tp: TensorParallel, name: str) -> None:
    """This rank's ``ceil(V/tp)`` vocabulary rows; rows past ``vocab`` (last shard) are zero."""
    rows = param.shape[0]
    _check_shape(loaded, (vocab, *param.shape[1:]), name)
    start = tp.rank * rows
    n = max(0, min(rows, vocab - start))
    _copy(param[:n], loaded[start:start + n])
    param[n:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split by vocabulary: weight ``[ceil(V/tp), H]``. Each rank looks up the
    ids in its shard, zeros the others, and one all-reduce sums the ranks (exact: one rank
    contributes each row, the rest add zeros)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__(tp.vocab_rows(vocab), hidden)
        self.vocab, self.tp = vocab, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.num_embeddings
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return self.tp.comm.all_reduce(out)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                      name: str = "") -> None:
        _load_vocab_rows(getattr(self, param_name).data, loaded, self.vocab, self.tp, name)


class ParallelLMHead(nn.Linear):
    """LM head rows split by vocabulary like :class:`VocabParallelEmbedding` (so a tied head
    shares its shard): ``forward`` gives this rank's logits ``[N, ceil(V/tp)]``; the full
    ``[N, V]`` exists only after :meth:`TPComm.gather_columns` on rank 0, which samples."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__(hidden, tp.vocab_rows(vocab), bias=False)
        self.vocab, self.tp = vocab, tp

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard: Optional[Hashable] = None,
                      name: str = "") -> None:
        _load_vocab_rows(getattr(self, param_name).data, loaded, self.vocab, self.tp, name)
