"""Per-sequence recurrent state of hybrid models (Qwen3.5's Gated DeltaNet layers).

A GDN layer keeps, per sequence, the last ``kernel - 1`` conv inputs and an ``[HV, K, V]``
delta-rule state (SCALE.md §3.3) instead of K/V per token. The delta-rule state is stored in
``ssm_state_dtype`` (vLLM's ``mamba_ssm_cache_dtype``): fp32 by default, bf16 on request (half the
bytes decode reads and writes per step; every kernel still computes in fp32). ``StatePool``
holds them in fixed slots on the device; ``StateSlotManager`` (a ``BlockManager``) decides who
owns which slot.

Invariant: a sequence that holds blocks owns the state slot numbered by its block-table row
(``seq.table_row``), and slot ``num_slots`` is a scratch slot for the padding rows of a CUDA
graph. The slot's state is that of the sequence's first ``num_cached_tokens`` tokens once the
steps scheduled so far have run (one stream: a later step sees it). Consequences:
  * allocation, release and preemption need no extra bookkeeping: the row comes and goes with
    the blocks (a preempted sequence drops its state and recomputes it, like its K/V);
  * a prefill from position 0 starts from a zero state; a later chunk continues the slot's;
  * fork(n): the children get fresh rows, and the runner copies the parent's state into them
    after the step's forward (``ScheduledBatch.forks``): no recomputation;
  * prefix caching is off: a cache hit would skip tokens whose state nobody has.
Rows are bounded by the pool (``num_slots``): a sequence is admitted, or forked, only if a
slot is free, so the state counts in admission.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.block_manager import BlockManager
from asyncrl.engine.sequence import Sequence


SSM_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ssm_state_dtype(name: Optional[str], model_config) -> torch.dtype:
    """The delta-rule state's storage dtype for ``mamba_ssm_cache_dtype=name`` (vLLM's option and
    values). ``None`` / "auto": the checkpoint's own ``mamba_ssm_dtype`` (config.json; every released
    Qwen3.5 names float32, and vLLM's Qwen3.5 config hook reads the same key), else float32. vLLM's
    generic fallback without that key is the model dtype; we keep fp32 there because an RL rollout's
    log-probs are compared with the trainer's, whose delta rule keeps its state in fp32."""
    source = "mamba_ssm_cache_dtype"
    if name in (None, "auto"):
        name, source = model_config.extra.get("mamba_ssm_dtype") or "float32", "the checkpoint's mamba_ssm_dtype"
    if name not in SSM_STATE_DTYPES:
        raise ValueError(f"{source}={name!r}: the engine knows 'auto', " + ", ".join(map(repr, SSM_STATE_DTYPES)))
    return SSM_STATE_DTYPES[name]


class StatePool:
    """conv[l] ``[num_slots + 1, C, kernel - 1]`` (model dtype), ssm[l] ``[num_slots + 1, HV, K, V]``
    (``ssm_dtype``, fp32 by default), for each GDN layer l; the last slot is scratch."""

    def __init__(self, layers, num_slots: int, dtype: torch.dtype, device: torch.device,
                 ssm_dtype: torch.dtype = torch.float32):
        self.num_slots = num_slots
        self.scratch = num_slots
        self.ssm_dtype = ssm_dtype
        self.conv, self.ssm = [], []
        for gdn in layers:  # GatedDeltaNet modules: the pool binds each layer's views
            gdn.conv_state = torch.zeros(num_slots + 1, gdn.conv_dim, gdn.kernel - 1, dtype=dtype, device=device)
            gdn.ssm_state = torch.zeros(num_slots + 1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim,
                                        dtype=ssm_dtype, device=device)
            self.conv.append(gdn.conv_state)
            self.ssm.append(gdn.ssm_state)

    @staticmethod
    def bytes_per_slot(layers, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
        return sum(g.conv_dim * (g.kernel - 1) * dtype.itemsize
                   + g.num_v_heads * g.head_k_dim * g.head_v_dim * ssm_dtype.itemsize for g in layers)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """State of slots ``src [n]`` into slots ``dst [n]`` (fork), every layer."""
        for conv, ssm in zip(self.conv, self.ssm):
            conv.index_copy_(0, dst, conv.index_select(0, src))
            ssm.index_copy_(0, dst, ssm.index_select(0, src))

    def release(self, layers) -> None:
        for gdn in layers:
            gdn.conv_state = gdn.ssm_state = torch.empty(0)
        self.conv, self.ssm = [], []


class StateSlotManager(BlockManager):
    """A ``BlockManager`` whose block-table rows are state slots: at most ``num_slots`` of them,
    never grown; no prefix cache (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int, num_slots: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False, max_blocks_per_seq=max_blocks_per_seq)
        self.tables = np.full((num_slots, max_blocks_per_seq), num_blocks, np.int32)
        self.free_rows = list(range(num_slots - 1, -1, -1))

    def can_allocate(self, seq: Sequence) -> bool:
        return bool(self.free_rows) and super().can_allocate(seq)

    def fork_cost(self, parent: Sequence) -> int:
        return super().fork_cost(parent) if self.free_rows else math.inf

    def _bind_row(self, seq: Sequence) -> None:
        assert self.free_rows, "no free state slot (admission should have checked)"
        super()._bind_row(seq)


def state_host_arrays(batch, rows: int, scratch: int, packed: bool = False) -> list[np.ndarray]:
    """Host arrays of a step's state metadata: gathered steps (prefill / CPU) send
    slots, new-token counts and init flags ``[B]`` (with ``packed``, the GPU prefill through FLA,
    also ``cu_seqlens [B + 1]`` and FLA's chunk indices ``[NT, 2]``); paged decode sends slots
    ``[rows]`` (padding rows -> the scratch slot)."""
    slots = np.fromiter((s.table_row for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
    if rows:  # paged decode bucket
        padded = np.full(rows, scratch, dtype=np.int64)
        padded[:len(slots)] = slots
        return [padded]
    lens = np.fromiter((s.num_scheduled_tokens for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
    init = (np.asarray(batch.starts, dtype=np.int64) > 0).astype(np.int64)  # 1: continue the slot's state
    if not packed:
        return [slots, lens, init]
    from asyncrl.engine.models.gated_delta import fla_chunk_indices

    cu = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lens)])
    return [slots, lens, init, cu, fla_chunk_indices(lens)]


def attach_state(meta, arrays: list[torch.Tensor]) -> None:
    """Set the metadata's state fields from the device copies of ``state_host_arrays`` (none: no state)."""
    if not arrays:
        return
    meta.state_slots = arrays[0]
    if len(arrays) >= 3:
        meta.state_lens, meta.state_init = arrays[1], arrays[2]
    if len(arrays) == 5:
        meta.state_cu_seqlens, meta.state_chunk_indices = arrays[3], arrays[4]


def fork_slots(batch) -> list[np.ndarray]:
    """(src, dst) slot ids ``[n]`` int64 of the step's forks (parent row -> child row), or nothing."""
    if not batch.forks:
        return []
    return [np.array([p.table_row for p, _ in batch.forks], dtype=np.int64),
            np.array([c.table_row for _, c in batch.forks], dtype=np.int64)]
