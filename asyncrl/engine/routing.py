"""Routing capture for routing replay (R3): the experts the engine chose for every token.

``RoutingRecorder`` owns a device buffer ``[(num_blocks + 1) * block_size, L_moe, K]`` int16
indexed by KV slot, like the K/V cache (SGLang's and vLLM's layout, SCALE.md §3.5): each MoE
layer writes the ids it chose for the step's tokens at their slots (``SparseMoeBlock``), so a
fork's children read their prompt's routing through the shared blocks (the copied partial
block is copied here too) and a prefix-cache hit carries the routing computed with it.

When a sequence finishes, ``gather(seq)`` queues a device gather of positions
``0 .. len - 2`` (every token that went through a forward; the last sampled token did not)
through its block table, before the blocks can be reused (the scheduler calls it before it
frees them; later steps are queued after it on the stream). The host copy happens when the
completion is collected: ``Completion.routed_experts`` ``[len - 1, L_moe, K]`` int16, in the
row layout the trainer's forward uses (prompt then completion, ``training/routing_replay.py``).
"""
from __future__ import annotations

import torch


class RoutingRecorder:
    def __init__(self, routers, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        top_k = {r.top_k for r in routers}
        if len(top_k) != 1:
            raise ValueError(f"routing capture needs one top-k across MoE layers, got {sorted(top_k)}")
        self.num_layers, self.top_k = len(routers), top_k.pop()
        self.buffer = torch.zeros((num_blocks + 1) * block_size, self.num_layers, self.top_k, dtype=torch.int16,
                                  device=device)
        for i, router in enumerate(routers):
            router.routing_buffer, router.moe_index = self.buffer, i

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, num_tokens: int) -> None:
        """The first ``num_tokens`` slots of blocks ``src [n]`` into ``dst [n]`` (fork)."""
        view = self.buffer.view(-1, self.block_size, self.num_layers, self.top_k)
        view[dst, :num_tokens] = view[src, :num_tokens]

    def gather(self, seq) -> None:
        """Queue the gather of ``seq``'s routing (positions 0 .. len - 2) into ``seq.routed_experts``."""
        n = len(seq.token_ids) - 1
        if n <= 0 or not seq.block_table:
            seq.routed_experts = None
            return
        pos = torch.arange(n)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        slots = (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.buffer.device)
        seq.routed_experts = self.buffer.index_select(0, slots)

    def release(self, routers) -> None:
        for router in routers:
            router.routing_buffer = None
        self.buffer = torch.empty(0)
