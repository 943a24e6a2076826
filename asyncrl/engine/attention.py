"""Attention over the paged KV cache, and the per-step metadata that drives it.

KV cache layout, per layer: ``k_cache, v_cache: [num_blocks + 1, block_size, Hkv, D]``.
A token's *slot* is ``block_id * block_size + offset``. The last block is a scratch
block: padded rows of a batch write their K/V there, so no kernel needs a "skip" branch.

Two ways to attend:
  * gathered (prefill, and every step on CPU): on CUDA in fp16/bf16, each sequence's keys are
    gathered into one packed ``[sum ctx, Hkv, D]`` tensor and FlashAttention-2's varlen kernel
    attends (causal, bottom-right aligned: a chunk starting at position s sees keys < s + i + 1),
    no padding and no mask (``varlen_attention``); elsewhere into a padded ``[B, Lk, Hkv, D]``
    tensor with one SDPA call under a boolean mask. Prefill is compute-bound, so the gather is
    cheap next to the matmuls.
  * paged decode (GPU): a Triton kernel reads K/V in place through the block table
    (``triton_decode.py``); gathering there would cost 11x (ENGINE.md §3.1). When rows
    share prefix blocks (GRPO groups), cascade decode reads each shared prefix once per
    group (``cascade.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class AttentionMetadata:
    """Per-step inputs of every attention layer (same for all layers).

    T = number of query tokens in the step (packed, no batch dim), B = sequences.
      slot_mapping [T]        where each new token's K/V is written
      -- gathered path --
      q_index      [B, Lq]    row b: indices into the T tokens (padded with 0)
      q_out_index  [T]        position of each real token in the flattened [B*Lq]
      kv_slots     [B, Lk]    slot of key j of sequence b (padded -> scratch slot)
      q_pos        [B, Lq]    position of each query (0 on padding); key_lens [B] keys of each sequence
      (``gathered_mask()`` builds [B, 1, Lq, Lk]: True where query may attend key; None when ``causal``)
      cu_seqlens_q / cu_seqlens_k [B + 1] int32, kv_packed_slots [sum key_lens] int64, max_q, max_k:
      the same step packed for the varlen kernel (queries in step order; keys [0, key_lens[b]) of each b)
      -- paged decode path (one query token per sequence) --
      block_tables [B, max_blocks] int32, context_lens [B] int32; query_len tokens per sequence
      (T = B * query_len, packed; 1 for decode, K + 1 for a speculative verify step); longest_first [B]
      int32: the rows by context length, longest first, stable (made on the host with the step's inputs;
      None: ``decode_order`` sorts ``context_lens`` on the device)
      -- cascade decode (shared prefixes; ``cascade.py`` layout), both or neither --
      suffix_start [B] int32, cascade_tiles [T, 2 + MPT] int32
      -- recurrent-state layers (hybrid models; ``state_pool.py``) --
      state_slots [B] int64 (paged decode: [rows], padding -> scratch slot); gathered steps also
      state_lens [B] int64 (tokens this step) and state_init [B] int64 (0: start from a zero state);
      GPU steps with FLA also state_cu_seqlens [B + 1] int64 and state_chunk_indices [NT, 2] int64
      (the packed tokens' sequence bounds and FLA's chunk list, built on the host: no sync)
    """

    slot_mapping: torch.Tensor
    q_index: Optional[torch.Tensor] = None
    q_out_index: Optional[torch.Tensor] = None
    kv_slots: Optional[torch.Tensor] = None
    q_pos: Optional[torch.Tensor] = None
    key_lens: Optional[torch.Tensor] = None
    causal: bool = False  # gathered: a fresh batch of equal prompts, the mask is plain causal
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    kv_packed_slots: Optional[torch.Tensor] = None
    max_q: int = 0
    max_k: int = 0
    block_tables: Optional[torch.Tensor] = None
    context_lens: Optional[torch.Tensor] = None
    paged_decode: bool = False
    suffix_start: Optional[torch.Tensor] = None
    cascade_tiles: Optional[torch.Tensor] = None
    state_slots: Optional[torch.Tensor] = None
    state_lens: Optional[torch.Tensor] = None
    state_init: Optional[torch.Tensor] = None
    state_cu_seqlens: Optional[torch.Tensor] = None
    state_chunk_indices: Optional[torch.Tensor] = None
    query_len: int = 1  # paged decode: query tokens per sequence (> 1: a speculative verify step)
    longest_first: Optional[torch.Tensor] = None
    _decode_order: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    _mask: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def gathered_mask(self) -> Optional[torch.Tensor]:
        """The padded path's ``[B, 1, Lq, Lk]`` mask (causal, in range), built on the device by the first
        layer that asks (the varlen path never does); None for a plain causal batch (``causal``)."""
        if self._mask is None and not self.causal:
            j = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            self._mask = ((j[None, None, :] <= self.q_pos[:, :, None])
                          & (j[None, None, :] < self.key_lens[:, None, None])).unsqueeze(1)
        return self._mask

    def decode_order(self) -> torch.Tensor:
        """Paged decode: the sequences longest first ``[B]`` int32: ``longest_first`` when the host sent it,
        else ``longest_first_order`` on the device, made by the first layer whose decode launch orders its
        programs and shared by the rest."""
        if self._decode_order is None:
            from asyncrl.engine.triton_decode import longest_first_order

            self._decode_order = (self.longest_first if self.longest_first is not None
                                  else longest_first_order(self.context_lens))
        return self._decode_order


@dataclass(frozen=True)
class GatheredShape:
    """The host scalars of a gathered step: ``causal`` (a fresh batch of equal-length prompts: the mask
    is plain causal), the longest query run and key range (the varlen kernel's ``max_q`` / ``max_k``)."""

    causal: bool
    max_q: int
    max_k: int


@dataclass
class GatheredHost:
    """Host (numpy) arrays of a gathered step; see ``AttentionMetadata`` for shapes. ``q_pos
    [B, Lq]`` (position of each query, 0 on padding) and ``ctx [B]`` let the device build the
    [B, 1, Lq, Lk] mask itself: it never crosses the bus. ``cu_q`` / ``cu_k`` (int32) and
    ``kv_packed`` are the varlen kernel's view of the same step."""

    slot_mapping: np.ndarray
    q_index: np.ndarray
    q_out_index: np.ndarray
    kv_slots: np.ndarray
    q_pos: np.ndarray
    ctx: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    kv_packed: np.ndarray
    shape: GatheredShape

    def arrays(self) -> list[np.ndarray]:
        return [self.slot_mapping, self.q_index, self.q_out_index, self.kv_slots, self.q_pos, self.ctx,
                self.cu_q, self.cu_k, self.kv_packed]


def _cumulative(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` int32: FlashAttention's ``cu_seqlens``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def gathered_host_arrays(block_tables: list[list[int]], start_positions: list[int], num_new_tokens: list[int],
                         block_size: int, scratch_block: int) -> GatheredHost:
    """Numpy metadata for a step where sequence b computes tokens ``[start_b, start_b + n_b)``.

    Keys ``[0, start_b + n_b)`` are attended (cached prefix + the new tokens, whose K/V
    the layer writes into the cache before attending). Built on the host in bulk so the
    engine sends it with the step's one pinned copy (a pageable ``.to(device)`` waits for
    the device to finish the previous step: prefill steps then never overlapped).
    """
    B = len(block_tables)
    starts = np.asarray(start_positions, dtype=np.int64)
    nnew = np.asarray(num_new_tokens, dtype=np.int64)
    ctx = starts + nnew
    lq, lk = int(nnew.max()), int(ctx.max())
    max_blocks = (lk + block_size - 1) // block_size
    bt = np.full((B, max_blocks), scratch_block, dtype=np.int64)
    for b, table in enumerate(block_tables):
        m = min(len(table), max_blocks)
        bt[b, :m] = table[:m]
    j = np.arange(lk)
    kv_slots = bt[:, j // block_size] * block_size + j % block_size  # [B, Lk]
    in_range = j[None, :] < ctx[:, None]
    kv_slots = np.where(in_range, kv_slots, scratch_block * block_size)
    new_key = (j[None, :] >= starts[:, None]) & in_range  # this step's keys, row-major
    slot_mapping = kv_slots[new_key]
    i = np.arange(lq)
    q_valid = i[None, :] < nnew[:, None]  # [B, Lq]
    offsets = np.cumsum(nnew) - nnew
    q_index = np.where(q_valid, offsets[:, None] + i[None, :], 0)
    q_pos = np.where(q_valid, starts[:, None] + i[None, :], 0)  # padded rows see key 0 only
    q_out_index = np.flatnonzero(q_valid.reshape(-1))
    causal = bool((starts == 0).all()) and bool((nnew == nnew[0]).all())
    return GatheredHost(slot_mapping, q_index, q_out_index, kv_slots, q_pos, ctx, _cumulative(nnew),
                        _cumulative(ctx), kv_slots[in_range], GatheredShape(causal, lq, lk))


def gathered_metadata(slot_mapping: torch.Tensor, q_index: torch.Tensor, q_out_index: torch.Tensor,
                      kv_slots: torch.Tensor, q_pos: torch.Tensor, ctx: torch.Tensor, cu_q: torch.Tensor,
                      cu_k: torch.Tensor, kv_packed: torch.Tensor, shape: GatheredShape) -> AttentionMetadata:
    """``AttentionMetadata`` from ``GatheredHost.arrays()`` on the device and its ``shape``."""
    return AttentionMetadata(slot_mapping=slot_mapping, q_index=q_index, q_out_index=q_out_index,
                             kv_slots=kv_slots, q_pos=q_pos, key_lens=ctx, causal=shape.causal, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, kv_packed_slots=kv_packed, max_q=shape.max_q, max_k=shape.max_k)


def build_gathered_metadata(block_tables: list[list[int]], start_positions: list[int], num_new_tokens: list[int],
                            block_size: int, scratch_block: int, device: torch.device) -> AttentionMetadata:
    """``gathered_host_arrays`` sent to ``device`` (plain copies: for tests and one-off calls)."""
    host = gathered_host_arrays(block_tables, start_positions, num_new_tokens, block_size, scratch_block)
    return gathered_metadata(*(torch.from_numpy(a).to(device) for a in host.arrays()), host.shape)


FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0


def kv_cache_dtype(name: Optional[str], model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (``None`` / "auto"), or e4m3 ("fp8": vLLM's
    ``kv_cache_dtype="fp8"`` with its default scale 1.0, i.e. K/V stored as they are, saturated at
    +-448: half the bytes per token, so decode attention reads half as much)."""
    if name in (None, "auto"):
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV
    raise ValueError(f"kv_cache_dtype={name!r}: the engine knows 'auto' and 'fp8' (e4m3)")


def raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as uint8 when it is FP8 (index_copy_ / index_put have no float8 kernels)."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV else cache


def _to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` in the cache's dtype, viewed as the cache's ``raw`` bytes (FP8: saturated, not NaN)."""
    if cache.dtype == FP8_KV:
        return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV).view(torch.uint8)
    return x.to(cache.dtype)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an integer ``index`` of any shape into dim 0: ``[*index.shape, *x.shape[1:]]``.

    Why not ``x[index]``: advanced indexing runs a strided gather per element, ``index_select`` copies
    whole rows; on CPU (torch 2.13, one thread) gathering 1,280 rows of a quickstart-sized KV cache
    takes 48 us by indexing and 10 us by ``index_select``, and the CPU decode gathers K and V in every
    layer of every step."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V at ``slots`` (any shape) as ``[*slots.shape, Hkv, D]`` in ``dtype``."""
    Hkv, D = cache.shape[2], cache.shape[3]
    return take_rows(raw(cache).view(-1, Hkv, D), slots).view(cache.dtype).to(dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into the cache at ``slot_mapping [T]``."""
    Hkv, D = k.shape[1], k.shape[2]
    raw(k_cache).view(-1, Hkv, D).index_copy_(0, slot_mapping, _to_cache(k, k_cache))
    raw(v_cache).view(-1, Hkv, D).index_copy_(0, slot_mapping, _to_cache(v, v_cache))


# Masked SDPA on CUDA without cuDNN's backend: cuDNN builds an execution plan for every new (Lq, Lk)
# shape, 60-75 ms each and up to 1.7 s (H200, torch 2.11, bench/RESULTS.md 2026-12-04), and the
# gathered path's shapes change every prefill and every speculative catch-up; the flash and
# memory-efficient kernels take any shape at once (0.4-0.8 ms for the same calls).
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for shapes that change call to call: on CUDA with cuDNN's
    backend off (``NO_CUDNN``), elsewhere as it is."""
    if q.is_cuda:
        with sdpa_kernel(NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# The varlen path (``varlen_attention``): FlashAttention-2 as PyTorch ships it. On H200 (session 46) the padded
# path ran workload (c)'s prefill (28 prompts of 100-1,024 tokens a step) at 163k tok/s against 455k for (a)'s
# equal prompts: it pads every sequence to the longest, repeats K/V per query head and computes the full
# masked square. Off (``VARLEN_PREFILL = False``) for A/B benches.
VARLEN_PREFILL = True


@functools.lru_cache(maxsize=None)
def _flash_capable(device_index: int) -> bool:
    """FlashAttention-2 runs on NVIDIA sm80 and later (A100, H100/H200, ...), not on older cards or ROCm."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def takes_varlen(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``gathered_attention`` runs ``varlen_attention``: CUDA on sm80+, fp16/bf16 queries, a head dim
    FlashAttention-2 takes (<= 256, a multiple of 8), and the packed metadata present."""
    D = q.shape[-1]
    return (VARLEN_PREFILL and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D <= 256 and D % 8 == 0
            and meta.cu_seqlens_q is not None and _flash_capable(q.device.index or 0))


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` (each sequence's queries contiguous, in step order) -> out ``[T, H, D]``: keys
    ``[0, key_lens[b])`` of each sequence gathered packed, then FlashAttention-2's varlen kernel, causal
    from the bottom right (query i of a run of n sees keys < key_lens[b] - n + i + 1: its position + 1);
    GQA native (no K/V repeat). ``aten._flash_attention_forward`` rather than
    ``torch.nn.attention.varlen.varlen_attn``: the public wrapper's signature changed between torch 2.10
    and 2.13 (``is_causal`` -> ``window_size``, ``enable_gqa``), the op's first ten arguments did not."""
    k = gather_kv(k_cache, meta.kv_packed_slots, q.dtype)  # [sum key_lens, Hkv, D]
    v = gather_kv(v_cache, meta.kv_packed_slots, q.dtype)
    return flash_varlen_causal(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, scale)


def flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """FlashAttention-2 varlen forward, causal from the bottom right: q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``
    packed by ``cu_q`` / ``cu_k`` ``[B + 1]`` int32 -> ``[Tq, H, D]``."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


def gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` -> out ``[T, H, D]`` attending through ``meta.kv_slots`` (or packed:
    ``varlen_attention``, where ``takes_varlen``)."""
    if takes_varlen(q, meta):
        return varlen_attention(q, k_cache, v_cache, meta, scale)
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    B, Lq = meta.q_index.shape
    qb = take_rows(q, meta.q_index).transpose(1, 2)  # [B, H, Lq, D]
    kb = gather_kv(k_cache, meta.kv_slots, q.dtype).transpose(1, 2)  # [B, Hkv, Lk, D]
    vb = gather_kv(v_cache, meta.kv_slots, q.dtype).transpose(1, 2)
    if q.is_cuda and H != Hkv:
        # the fused (mem-efficient) CUDA kernel takes a mask but not enable_gqa: expand
        # K/V heads rather than fall back to the math kernel's [B, H, Lq, Lk] scores
        kb, vb = kb.repeat_interleave(H // Hkv, 1), vb.repeat_interleave(H // Hkv, 1)
    mask = meta.gathered_mask()
    out = masked_sdpa(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=H != kb.shape[1])
    return take_rows(out.transpose(1, 2).reshape(B * Lq, H, D), meta.q_out_index)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's K/V, then attend. q ``[T, H, D]``, k/v ``[T, Hkv, D]``."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend_cached(q, k_cache, v_cache, meta, scale)


def attend_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` -> out ``[T, H, D]``, this step's K/V already in the cache (``store_kv``, or the
    fused write of ``triton_qkv.qkv_to_cache``)."""
    if meta.paged_decode:
        from asyncrl.engine.triton_decode import cascade_decode_attention, paged_decode_attention

        if meta.cascade_tiles is not None:
            return cascade_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                            meta.suffix_start, meta.cascade_tiles, scale)
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      query_len=meta.query_len, order=meta.decode_order)
    return gathered_attention(q, k_cache, v_cache, meta, scale)
