"""How one model splits over the ranks of a tensor-parallel engine (pure arithmetic, no comms).

Megatron/vLLM's split (SCALE.md §2.1): attention heads and the MLP's intermediate dim are cut
into ``size`` equal parts; KV heads too when there are at least ``size`` of them, else each
KV head is *replicated* on ``size / Hkv`` ranks (rank r holds KV head ``r // (size / Hkv)``,
the one its query heads read); the vocabulary is cut into ``ceil(V / size)``-row shards, the
last one padded with zero rows that are dropped before sampling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class TensorParallelError(ValueError):
    """A tensor-parallel size the model cannot be split by."""


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``comm`` (a :class:`~asyncrl.engine.parallel.comm.TPComm`)
    runs the collectives and is None when ``size == 1``: then every layer is a plain one."""

    size: int = 1
    rank: int = 0
    comm: Any = field(default=None, compare=False, repr=False)

    def heads(self, num_heads: int) -> int:
        """Query heads on this rank."""
        return num_heads // self.size

    def kv_heads(self, num_kv_heads: int) -> int:
        """KV heads on this rank (1 when replicated)."""
        return max(1, num_kv_heads // self.size)

    def kv_head_start(self, num_kv_heads: int) -> int:
        """Index of this rank's first KV head in the full model."""
        if num_kv_heads >= self.size:
            return self.rank * (num_kv_heads // self.size)
        return self.rank // (self.size // num_kv_heads)

    def vocab_rows(self, vocab: int) -> int:
        """Rows of every vocabulary shard (the last may extend past ``vocab``: zero padding)."""
        return -(-vocab // self.size)


SINGLE = TensorParallel()


def splits_evenly(size: int, heads: int, kv_heads: int, intermediate: int) -> bool:
    kv_ok = kv_heads % size == 0 or size % kv_heads == 0
    return size >= 1 and heads % size == 0 and intermediate % size == 0 and kv_ok


def valid_sizes(heads: int, kv_heads: int, intermediate: int) -> list[int]:
    """Every tensor-parallel size this model splits evenly by."""
    return [t for t in range(1, heads + 1) if splits_evenly(t, heads, kv_heads, intermediate)]


def check_tensor_parallel(config, size: int) -> None:
    """Raise :class:`TensorParallelError` naming the valid sizes unless ``config`` (a
    ``ModelConfig``) splits evenly over ``size`` ranks."""
    from asyncrl.engine.models.registry import model_class  # here: the models import this package

    if size > 1 and not model_class(config).splits_over_ranks():
        raise TensorParallelError(
            f"tensor_parallel_size={size}: the engine's {config.architecture} has layers tensor parallelism does "
            "not split yet (it covers the dense Qwen3 / Qwen2 / Llama / Mistral decoder); valid sizes: 1")
    h, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if splits_evenly(size, h, kv, inter):
        return
    raise TensorParallelError(
        f"tensor_parallel_size={size} does not split this model ({h} attention heads, {kv} KV heads, "
        f"intermediate size {inter}: heads and intermediate size must divide by it, KV heads must divide by it "
        f"or divide it); valid sizes: {', '.join(map(str, valid_sizes(h, kv, inter)))}")
