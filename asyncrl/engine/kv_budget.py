"""How many KV blocks fit on the GPU: what is really free, minus a reserve and an activation headroom.

    blocks = min(wanted, (free - total * (1 - gpu_memory_utilization) - activations) // block_bytes)

``free`` is the driver's free memory *after* PyTorch's caching allocator has handed its cached
blocks back, plus what stays reserved-but-unallocated (fragments of segments still in use, which
activations can reuse): ``mem_get_info`` alone counts cached-but-free blocks as used, so
temporaries of the load (or an fp32 model built and then cast) would shrink the pool. Cached
blocks of anything else in the process count as free too (a colocated trainer that already ran a
step): ``gpu_memory_utilization`` is what leaves the trainer its share, as in vLLM.

``activations`` is a per-token estimate of a prefill of ``max_num_batched_tokens`` tokens through
the widest MLP, plus the fp32 logits of a full decode batch. An MoE layer holds, per token,
``K`` routed rows of ``gate_up [2I]``, ``silu``, ``h [I]`` and the expert output ``[H]`` in the
model dtype, plus fp32 router probabilities ``[E]`` -- not the dense ``intermediate_size``.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.moe import is_moe_layer, num_experts

GB = 2**30
MIN_BLOCKS = 16


@dataclass(frozen=True)
class KvBudget:
    """The numbers one KV-pool sizing used (bytes); ``blocks`` is what the pool gets.

    Invariant: ``blocks == max(MIN_BLOCKS, min(wanted_blocks, usable // block_bytes))`` with
    ``usable = free - reserve - activations``."""

    weights: int
    free: int          # driver-free after empty_cache + reserved-but-unallocated
    total: int
    reserve: int       # total * (1 - gpu_memory_utilization)
    activations: int
    block_bytes: int
    wanted_blocks: int  # max_num_seqs full-length sequences

    @property
    def blocks(self) -> int:
        usable = self.free - self.reserve - self.activations
        return max(MIN_BLOCKS, min(self.wanted_blocks, int(usable // max(self.block_bytes, 1))))

    def line(self, block_size: int) -> str:
        """One line for the engine's start: where the memory went and what the pool got."""
        capped = "max_num_seqs x max_model_len" if self.blocks == self.wanted_blocks else "memory"
        return (f"KV pool: weights {self.weights / GB:.1f} GiB, free {self.free / GB:.1f} of {self.total / GB:.1f} GiB, "
                f"reserve {self.reserve / GB:.1f} GiB, activation headroom {self.activations / GB:.1f} GiB -> "
                f"{self.blocks} blocks x {block_size} = {self.blocks * block_size:,} tokens "
                f"({self.block_bytes / 2**20:.2f} MiB/block; capped by {capped})")


def moe_width(c: ModelConfig, dtype_bytes: int) -> int:
    """Bytes per token an MoE layer holds at prefill: K routed rows of gate_up (2I), silu(gate) and
    h (I each), the weighted expert output (H), in the model dtype; fp32 router probs (and their
    softmax input) over E; a shared expert's gate_up + h."""
    experts = num_experts(c)
    if not experts:
        return 0
    k, inter = int(c.extra["num_experts_per_tok"]), int(c.extra["moe_intermediate_size"])
    shared = int(c.extra.get("shared_expert_intermediate_size") or 0)
    return dtype_bytes * (k * (4 * inter + c.hidden_size) + 3 * shared) + 4 * 2 * experts


def activation_bytes(c: ModelConfig, dtype_bytes: int, max_tokens: int, max_seqs: int) -> int:
    """Headroom for a prefill of ``max_tokens`` tokens and the fp32 logits of ``max_seqs`` rows.

    Trunk: 32 bytes per (hidden + dense intermediate) element and token (the engine's estimate
    since its first GPU runs: fp32-sized, 8 live tensors); an MoE model whose every layer is sparse
    counts its routed rows (``moe_width``) instead of the dense ``intermediate_size`` it never runs."""
    moe = moe_width(c, dtype_bytes)
    dense_layers = not moe or not all(is_moe_layer(c, i) for i in range(c.num_hidden_layers))
    per_token = 32 * (c.hidden_size + (c.intermediate_size if dense_layers else 0))
    per_token = max(per_token, 32 * c.hidden_size + moe)
    return max_tokens * per_token + max_seqs * c.vocab_size * 4 * 6


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes: the caching allocator's cached blocks returned to the driver first,
    and what stays reserved but unallocated counted as free."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (the weights the GPU holds)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
