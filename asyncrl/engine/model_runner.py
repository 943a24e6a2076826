"""ModelRunner: owns the model, the KV pool and the CUDA graphs; runs one step.

``launch(batch)`` = ``prepare`` (host: the step's input arrays, a picklable ``StepInputs``)
-> ``execute`` (device: inputs -> forward (graph replay for GPU decode) -> copy forked
partial blocks -> logits of the rows that sample -> sample -> start the copy of the
sampled tokens to the host); it does not wait for the device. ``fetch(handle)`` waits for
that step's tokens: the one device->host sync per step, which the engine places after
launching the NEXT step (overlapped scheduling, ``LLM``). ``run`` = fetch(launch).

Tensor parallelism (``model.tp.size > 1``): rank 0 runs the scheduler and ``prepare``; its
``followers`` (``parallel/workers.py``) send each ``StepInputs`` to the other ranks, which
``execute`` it too (same collectives in the same order). Rank 0 gathers the vocabulary shards
of the logits, samples from the full distribution and broadcasts the tokens (the next step's
pending input ids live on every rank's device).

KV pool: per layer ``[num_blocks + 1, block_size, Hkv, D]`` in the model's dtype, or e4m3 with
``kv_cache_dtype="fp8"`` (twice the blocks in the same memory); block ``num_blocks`` is the
scratch block that padded rows write to (never handed out by the BlockManager).
Hybrid models (Qwen3.5) have K/V in their full-attention layers only, and a ``StatePool`` of
per-sequence recurrent state for the others (``state_pool.py``; slot = block-table row).
MoE models can record the experts chosen per token (``RoutingRecorder``, routing replay).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.attention import (AttentionMetadata, GatheredShape, gathered_host_arrays, gathered_metadata,
                                      kv_cache_dtype, raw)
from asyncrl.engine.cascade import CascadeBuffers
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.cuda_graphs import capture_graphs, current_capture_stream
from asyncrl.engine.fp8 import check_fp8_device
from asyncrl.engine.kv_budget import KvBudget, activation_bytes, device_memory, module_bytes
from asyncrl.engine.models.gated_delta import fla_available
from asyncrl.engine.models.decoder import CausalLM
from asyncrl.engine.parallel.layers import ParallelLMHead
from asyncrl.engine.sampler import Sampler, position_keys, sequence_keys
from asyncrl.engine.scheduler import ScheduledBatch
from asyncrl.engine.staging import DeviceToHost, HostToDevice
from asyncrl.engine.state_pool import StatePool, attach_state, fork_slots, ssm_state_dtype, state_host_arrays

logger = logging.getLogger(__name__)

# Rows the one-pass sampler takes (no top-k / top-p): the LM head's GEMM with the sampler in its epilogue
# (``triton_lm_sampler``: the [B, V] logits never written) instead of ``F.linear`` then ``triton_sampler``. Off until
# an H200 A/B shows it faster (issue 23); read at each step (and, for the sampling graphs, at their capture).
FUSED_LM_HEAD_SAMPLER = False


@dataclass
class StepInputs:
    """The host side of one step: every array the device side reads, in the order of its one
    host->device copy, and how to read them. Picklable: TP rank 0 sends it to the other ranks.

    ``arrays`` = inputs (``num_inputs``), then sampling (``num_sampling``: floats ``[2, S]``,
    ints ``[2, S]`` [, sample rows]), then forked-block copies (src, dst: 0 or 2 arrays), then
    forked recurrent-state slots (src, dst: 0 or 2 arrays; hybrid models).
      gathered step: ids, positions, src, the ``GatheredHost`` arrays, [state arrays,] logit ends
      paged decode:  ids, positions, slots, src, block tables, context lengths [, state slots]
                     [, cascade plan]
    """

    arrays: list
    num_inputs: int
    num_sampling: int = 0
    use_filter: bool = False  # a sampling row uses top-k / top-p
    copy_tokens: int = 0      # slots to copy per forked partial block (0: no copies)
    max_src: int = -1         # largest pending-token row (-1: every input id is on the host)
    pending_all: bool = False  # decode: every real row's input id is pending (padding rows read row 0)
    gathered: Optional[GatheredShape] = None  # gathered: the step's host scalars (causal, max_q, max_k)
    paged_rows: int = 0       # paged decode: rows computed (a graph bucket, or the real rows); 0: gathered
    real_rows: int = 0        # paged decode: real sequences among them
    graphed: bool = False     # paged decode: replay the bucket's CUDA graph
    num_state: int = 0        # hybrid: recurrent-state arrays among the inputs (``state_host_arrays``)
    state_copies: bool = False  # hybrid: the last two arrays fork recurrent-state slots


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, max_model_len: int, followers=None,
                 extra_block_bytes: int = 0, record_features: bool = False):
        """``followers``: on rank 0 of a TP engine, the other ranks (``run_step(StepInputs)``).
        ``extra_block_bytes``: memory per KV block taken by another pool with the same block
        geometry (a speculative draft model's K/V, ``spec/draft_model.py``; TP=1 only).
        ``record_features``: keep every cached position's final hidden state at its KV slot
        (``self.features [(num_blocks + 1) * block_size, hidden]``, written by the model's own
        forward, CUDA graphs included): an EAGLE proposer's input, so that positions decoded
        without speculation need no second target forward (its bytes are in ``extra_block_bytes``)."""
        self.model = model
        self.tp, self.followers = model.tp, followers
        self.extra_block_bytes = extra_block_bytes
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and self.kv_dtype.itemsize == 1:
            check_fp8_device(self.device, "kv_cache_dtype='fp8'", (8, 9))
        self.is_cuda = self.device.type == "cuda"
        c = model.config
        self.num_heads = self.tp.heads(c.num_attention_heads)  # this rank's (all of them at TP=1)
        self.num_kv_heads = self.tp.kv_heads(c.num_key_value_heads)
        linear = model.linear_layers() if hasattr(model, "linear_layers") else []
        # before sizing the KV pool from free memory: the states take their share first
        ssm_dtype = ssm_state_dtype(config.mamba_ssm_cache_dtype, c)  # checked for any model: a typo is named
        self.state_pool = (StatePool(linear, self.num_state_slots, self.dtype, self.device, ssm_dtype)
                           if linear else None)
        # hybrid prefill on GPU: FLA's varlen kernel over the packed tokens (metadata built on the host)
        self.packed_state_prefill = bool(linear) and self.is_cuda and fla_available()
        self.kv_budget: Optional[KvBudget] = None  # GPU sizing from memory: its numbers
        self.folded_weight_bytes = self._prepare_fused_gemms()  # also before the sizing: the pool leaves them room
        self.num_blocks = self._num_kv_blocks()
        if self.tp.size > 1:  # one block table for all ranks: the count that fits on every GPU
            self.num_blocks = self.tp.comm.min_int(self.num_blocks)
        self.scratch_block = self.num_blocks
        self._allocate_kv_cache()
        self.features: Optional[torch.Tensor] = None
        if record_features:  # before any graph capture: every captured forward writes it
            self.features = torch.zeros((self.num_blocks + 1) * self.block_size, model.config.hidden_size,
                                        dtype=self.dtype, device=self.device)
            model.feature_buffer = self.features
        self.routing = None
        if config.return_routed_experts and hasattr(model, "routers") and model.routers():
            from asyncrl.engine.routing import RoutingRecorder
            self.routing = RoutingRecorder(model.routers(), self.num_blocks, self.block_size, self.device)
        self.sampler = Sampler(self.device, compile=config.compile_sampler, triton=config.triton_sampler)
        self.h2d, self.d2h = HostToDevice(self.device), DeviceToHost(self.device)
        if self.is_cuda and (config.compile_sampler or config.triton_sampler) and self.tp.rank == 0:
            self._warmup_sampler()  # only rank 0 samples
        self.last_tokens: Optional[torch.Tensor] = None  # sampled by the last launched step
        self._keys_of: Optional[tuple[tuple[int, ...], np.ndarray]] = None  # (seq ids, their sequence_keys)
        self._uniform_of: Optional[tuple] = None  # ((S, temperature, top_p, top_k), floats, top_k, use_filter)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._bucket_views: dict[tuple[str, int], object] = {}  # per-bucket views of graph / plan buffers
        # shared-prefix (cascade) decode: plan buffers + a second graph per bucket
        self.cascade = (CascadeBuffers(self.num_heads, self.num_kv_heads, self.block_size,
                                       config.max_num_seqs, self.device)
                        if self.is_cuda and config.cascade_attention else None)
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # decode graphs that also sample (``EngineConfig.decode_graph_sampler``), per cascade on/off; TP=1 only
        # (rank 0 samples from every rank's gathered logits there)
        self.graph_sampler = (self.is_cuda and config.decode_graph_sampler and self.sampler.fast is not None
                              and self.tp.size == 1)
        self.sampling_graphs: dict[bool, dict[int, torch.cuda.CUDAGraph]] = {False: {}, True: {}}
        self.sampling_graph_steps = 0  # decode steps that sampled inside their graph (metrics, tests)
        if self.is_cuda and not config.enforce_eager:
            self._capture_cudagraphs()

    # ---- KV cache --------------------------------------------------------------
    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots: one per running sequence plus one partly prefilled waiting one."""
        return self.config.max_num_seqs + 1

    def _attention_layers(self) -> list:
        """The layers with a K/V cache (all of them, but the full-attention ones of a hybrid model)."""
        return [layer.self_attn for layer in self.model.model.layers if hasattr(layer, "self_attn")]

    def _prepare_fused_gemms(self) -> int:
        """The decoder's folded qkv / gate_up weights (``decoder.FOLD_NORMS``), made now on a GPU where the decode
        layers will fold: -> their bytes (0 where none)."""
        prepare = getattr(self.model.model, "prepare_fused_gemms", None)  # the dense decoder's
        if not (self.is_cuda and prepare):
            return 0
        made = prepare(self.dtype, self.device)
        if made:
            logger.info("folded decode weights (decoder.FOLD_NORMS): %.2f GiB", made / 2**30)
        return made

    def _block_bytes(self) -> int:
        per_layer = self.block_size * self.num_kv_heads * self.model.config.head_dim * self.kv_dtype.itemsize
        return 2 * len(self._attention_layers()) * per_layer + self.extra_block_bytes

    def _num_kv_blocks(self) -> int:
        """Explicit, else enough for max_num_seqs full-length sequences, capped by memory
        (GPU: ``kv_budget.KvBudget``, logged in one line and kept as ``self.kv_budget``;
        CPU: kv_memory_gb_cpu)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        want = self.config.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        if self.is_cuda:
            free, total = device_memory(self.device)
            act = activation_bytes(self.model.config, self.dtype.itemsize, self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs)
            self.kv_budget = KvBudget(module_bytes(self.model), free, total,
                                      int(total * (1 - self.config.gpu_memory_utilization)), act,
                                      self._block_bytes(), want)
            logger.info("%s", self.kv_budget.line(self.block_size))
            return self.kv_budget.blocks
        # a model without full-attention layers (an all-Gated-DeltaNet Qwen3.5) stores nothing per
        # block: its blocks only count tokens, so memory does not cap them
        cap = int(self.config.kv_memory_gb_cpu * 2**30 // max(self._block_bytes(), 1))
        return max(16, min(want, cap))

    def _allocate_kv_cache(self) -> None:
        c = self.model.config
        shape = (self.num_blocks + 1, self.block_size, self.num_kv_heads, c.head_dim)
        for attn in self._attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            if hasattr(attn, "fused_kv_write"):  # the dense decoder's Attention (not the hybrid's gated one)
                attn.fused_kv_write = self.is_cuda and self.config.fused_kv_write is not False

    def release(self) -> None:
        """Free the KV pool and CUDA graphs (the engine is unusable afterwards)."""
        self.graphs.clear()
        self.cascade_graphs.clear()
        self.sampling_graphs = {False: {}, True: {}}
        self.graph_vars = {}
        self._bucket_views.clear()
        for attn in self._attention_layers():
            attn.k_cache = torch.empty(0)
            attn.v_cache = torch.empty(0)
        if self.state_pool is not None:
            self.state_pool.release(self.model.linear_layers())
        if self.routing is not None:
            self.routing.release(self.model.routers())
        if self.features is not None:
            self.model.feature_buffer = self.features = None

    @staticmethod
    def _copy_arrays(copies: list[tuple[int, int, int]]) -> list[np.ndarray]:
        """(src, dst) block ids ``[C]`` int64 of the forked partial blocks, or nothing."""
        if not copies:
            return []
        return [np.array([c[0] for c in copies], dtype=np.int64), np.array([c[1] for c in copies], dtype=np.int64)]

    def copy_blocks(self, m: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy forked partial blocks ``src -> dst`` (block ids ``[C]`` on the device, sent with
        the step's transfer by ``_copy_arrays``): only the first ``m`` = max(num_tokens) slots
        (short GRPO prompts fill a fraction of a block)."""
        for attn in self._attention_layers():
            for cache in (raw(attn.k_cache), raw(attn.v_cache)):  # raw: FP8 caches copy as bytes
                head = cache[:, :m]  # whole-row copies (attention.take_rows); the dst blocks are distinct
                head.index_copy_(0, dst, head.index_select(0, src))
        if self.routing is not None:
            self.routing.copy_blocks(src, dst, m)
        if self.features is not None:
            view = self.features.view(-1, self.block_size, self.features.shape[1])
            view[dst, :m] = view[src, :m]

    @torch.inference_mode()
    def _warmup_sampler(self) -> None:
        """Compile the sampler now (the Triton kernels; or torch.compile for batch 1, which
        it specialises, and for the dynamic size): otherwise the first batch of 1 -- the
        tail of a run whose sequences end at different lengths -- compiles inside the
        timed generation."""
        V = self.model.config.vocab_size
        for B in (1, 3):
            logits = torch.zeros(B, V, dtype=self.dtype, device=self.device)
            floats = torch.ones(2, B, dtype=torch.float32, device=self.device)
            ints = torch.zeros(2, B, dtype=torch.int64, device=self.device)
            self.sampler(logits, floats, ints, False)
        torch.cuda.synchronize()

    # ---- inputs ----------------------------------------------------------------
    # Host arrays are built in bulk (numpy) and sent with ONE pinned async copy per step
    # (``HostToDevice``); a pending input token (overlapped scheduling) is read on the
    # device from the previous step's sampled tokens (``_resolve_ids``), never synced.
    def _gathered_host(self, batch: ScheduledBatch) -> list[np.ndarray]:
        """(ids, positions, src) ``[T]`` int64 of the step's packed tokens; ``src`` >= 0
        marks a pending token: its id is row ``src`` of the previous step's samples."""
        ids, pos = [], []
        for s, a in zip(batch.seqs, batch.starts):
            n = s.num_scheduled_tokens
            toks = s.token_ids[a:a + n]
            ids.extend(toks)
            ids.extend([0] * (n - len(toks)))  # the pending token's slot (decode only)
            pos.extend(range(a, a + n))
        src = batch.input_src if not batch.is_prefill else [-1] * len(ids)
        return [np.array(ids, dtype=np.int64), np.array(pos, dtype=np.int64), np.array(src, dtype=np.int64)]

    def _gathered_inputs(self, batch: ScheduledBatch) -> tuple[list[np.ndarray], GatheredShape]:
        """(inputs, shape) of a gathered step (prefill, or any step on CPU): ids, positions,
        src, the ``GatheredHost`` arrays and the logit ends."""
        host = gathered_host_arrays([s.block_table for s in batch.seqs], batch.starts,
                                    [s.num_scheduled_tokens for s in batch.seqs], self.block_size, self.scratch_block)
        return self._gathered_host(batch) + host.arrays() + [self._logit_ends(batch)], host.shape

    def _resolve_ids(self, ids: torch.Tensor, src: torch.Tensor, max_src: int,
                     pending_all: bool = False) -> torch.Tensor:
        """Input ids with pending tokens taken from the last launched step's samples. Every row
        pending (the overlapped decode's usual step): one gather instead of four kernels."""
        if max_src < 0:
            return ids
        prev = self.last_tokens
        assert prev is not None and prev.numel() > max_src, "pending token of an unknown step"
        if pending_all:
            return prev[src]
        return torch.where(src >= 0, prev[src.clamp(min=0)], ids)

    def _decode_paged_inputs(self, batch: ScheduledBatch, bs: int) -> list[np.ndarray]:
        """Host arrays for a paged decode of ``bs`` rows (real seqs, then padding rows that
        write the scratch block and attend one scratch token): ids, positions, slots, src
        ``[bs]`` int64, block tables ``[bs, W]`` int32, context lengths ``[bs]`` int32 and the rows
        longest context first ``[bs]`` int32 (``triton_decode.longest_first_order``'s order, sorted here: a
        device argsort per step cost ~19 us of a ~4 ms step on an H200, bench/RESULTS.md). A padding
        row's src is 0 (a valid row of any step that has pending tokens; its id is never used),
        so a step whose real rows are all pending gathers its ids in one op (``_resolve_ids``)."""
        bsz, n = self.block_size, len(batch.seqs)
        pos = np.zeros(bs, dtype=np.int64)
        pos[:n] = batch.starts
        src = np.zeros(bs, dtype=np.int64)
        src[:n] = batch.input_src
        ids = np.zeros(bs, dtype=np.int64)
        bt = np.full((bs, self._bt_width()), self.scratch_block, dtype=np.int32)
        if batch.block_tables is not None:  # gathered by the scheduler: no per-row Python
            bt[:n] = batch.block_tables
            ids[:n] = batch.last_ids
        else:
            for i, s in enumerate(batch.seqs):
                table = s.block_table
                bt[i, :len(table)] = table
                if src[i] < 0:  # not pending: the input is the last host token
                    ids[i] = s.token_ids[-1]
        slots = np.full(bs, self.scratch_block * bsz, dtype=np.int64)
        slots[:n] = bt[np.arange(n), pos[:n] // bsz].astype(np.int64) * bsz + pos[:n] % bsz
        ctx = np.ones(bs, dtype=np.int32)
        ctx[:n] = pos[:n] + 1
        order = np.argsort(-ctx, kind="stable").astype(np.int32)  # descending, ties in row order
        return [ids, pos, slots, src, bt, ctx, order]

    def _sample_arrays(self, batch: ScheduledBatch) -> tuple[list[np.ndarray], bool]:
        """([floats ``[2, S]`` fp32 = (temperature, top_p), ints ``[2, S]`` int64 = (noise key,
        top_k)], any top-k/top-p filtering) for the ``S`` sampling rows."""
        seqs = batch.sample_seqs
        S, p0 = len(seqs), seqs[0].params
        if all(s.params is p0 for s in seqs):  # one SamplingParams for the batch: the usual case
            values = (S, p0.temperature, p0.top_p, p0.top_k)  # by value: a caller may reuse the object
            if self._uniform_of is None or self._uniform_of[0] != values:  # else the last step's (read-only)
                top_p, top_k = np.full(S, p0.top_p, np.float32), np.full(S, p0.top_k, np.int64)
                self._uniform_of = (values, np.stack([np.full(S, p0.temperature, np.float32), top_p]), top_k,
                                    bool((top_k > 0).any() or (top_p < 1.0).any()))
            _, floats, top_k, use_filter = self._uniform_of
        else:
            temp = np.array([s.params.temperature for s in seqs], dtype=np.float32)
            top_p = np.array([s.params.top_p for s in seqs], dtype=np.float32)
            top_k = np.array([s.params.top_k for s in seqs], dtype=np.int64)
            floats, use_filter = np.stack([temp, top_p]), bool((top_k > 0).any() or (top_p < 1.0).any())
        keys = position_keys(self._sequence_keys(seqs), np.array(batch.key_positions, dtype=np.int64))
        return [floats, np.stack([keys, top_k])], use_filter

    def _sequence_keys(self, seqs) -> np.ndarray:
        """``sequence_keys`` ``[S]`` int64 of these rows (their seeds and sample indices), kept while
        the rows are the same sequences in the same order: a decode batch changes only when a
        sequence joins, finishes or is preempted, and the ~30 numpy ops of the mixing then run once
        per batch instead of every step (a sequence's seed and sample index never change)."""
        ids = tuple(s.seq_id for s in seqs)
        if self._keys_of is None or self._keys_of[0] != ids:
            self._keys_of = (ids, sequence_keys(np.array([s.seed for s in seqs], dtype=np.int64),
                                                np.array([s.sample_index for s in seqs], dtype=np.int64)))
        return self._keys_of[1]

    def _bt_width(self) -> int:
        return (self.max_model_len + self.block_size - 1) // self.block_size

    # ---- CUDA graphs -------------------------------------------------------------
    def _graph_sizes(self) -> list[int]:
        max_bs = min(self.config.max_num_seqs, 512)
        sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
        if sizes[-1] != max_bs:
            sizes.append(max_bs)
        return sizes

    @torch.inference_mode()
    def _capture_cudagraphs(self) -> None:
        sizes = self._graph_sizes()
        max_bs = sizes[-1]
        c = self.model.config
        g = self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.long, device=self.device),
            positions=torch.zeros(max_bs, dtype=torch.long, device=self.device),
            slot_mapping=torch.full((max_bs,), self.scratch_block * self.block_size, dtype=torch.long, device=self.device),
            block_tables=torch.full((max_bs, self._bt_width()), self.scratch_block, dtype=torch.int32, device=self.device),
            context_lens=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            decode_order=torch.arange(max_bs, dtype=torch.int32, device=self.device),  # a permutation of every [:bs]
            hidden=torch.zeros(max_bs, c.hidden_size, dtype=self.dtype, device=self.device),
        )
        if self.state_pool is not None:
            g["state_slots"] = torch.full((max_bs,), self.state_pool.scratch, dtype=torch.long, device=self.device)
        if self.graph_sampler:  # sampling inputs, the sampled tokens, and their read-back layout
            g.update(temp=torch.ones(max_bs, dtype=torch.float32, device=self.device),
                     keys=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
                     tokens=torch.zeros(max_bs, dtype=torch.int64, device=self.device),
                     sampled=torch.zeros(2 * max_bs, dtype=torch.float64, device=self.device))
        # (cascade, sampling) variants: a second graph per bucket for the shared-prefix decode, and each
        # again with the LM head + sampler inside
        variants = [(False, False)] + ([(True, False)] if self.cascade is not None else [])
        variants += [(c, True) for c, _ in variants] if self.graph_sampler else []
        captured = capture_graphs(sizes, *(partial(self._graph_decode, cascade=c, sampling=t) for c, t in variants),
                                  stream=current_capture_stream())  # the engine's own, if any
        for (c, t), graphs in zip(variants, captured):
            (self.sampling_graphs[c] if t else self.cascade_graphs if c else self.graphs).update(graphs)

    def _graph_decode(self, bs: int, cascade: bool, sampling: bool = False) -> None:
        """The decode forward of ``bs`` rows on the graph buffers (what a bucket's graph holds).
        ``sampling``: then the LM head and the one-pass sampler of all ``bs`` rows (padding rows'
        samples are never read), the tokens kept for the next step's pending ids and packed as
        ``DeviceToHost`` reads them: ``sampled[:2 bs]`` = tokens, then log-probs (fp64)."""
        g = self.graph_vars
        meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:bs], block_tables=g["block_tables"][:bs],
                                 context_lens=g["context_lens"][:bs], longest_first=g["decode_order"][:bs],
                                 paged_decode=True,
                                 state_slots=g["state_slots"][:bs] if "state_slots" in g else None,
                                 **(self._cascade_views(bs) if cascade else {}))
        g["hidden"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
        if sampling:
            tokens, logprobs = self._sample_unfiltered(g["hidden"][:bs], g["temp"][:bs], g["keys"][:bs])
            g["tokens"][:bs] = tokens
            packed = g["sampled"][:2 * bs].view(2, bs)
            packed[0] = tokens  # int64 -> fp64: exact below 2^53 (as DeviceToHost.start)
            packed[1] = logprobs

    def _sample_unfiltered(self, hidden: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor):
        """The LM head + one-pass sampler (``sampler.fast``) of ``hidden [S, H]`` at tp = 1: (tokens, log-probs),
        through ``triton_lm_sampler`` where ``FUSED_LM_HEAD_SAMPLER`` is on and the head is the plain one it
        takes (the sampling graphs and the steps after a forward alike)."""
        head = self.model.lm_head
        if FUSED_LM_HEAD_SAMPLER and type(head) is ParallelLMHead and head.tp.size == 1:
            from asyncrl.engine import triton_lm_sampler  # Triton: only where it runs

            if triton_lm_sampler.fits(hidden, head.weight):
                return triton_lm_sampler.lm_head_sample(hidden, head.weight, temperature, keys)
        return self.sampler.fast(head(hidden), temperature, keys)

    def _cascade_views(self, bs: int) -> dict:
        """The cascade metadata fields of bucket ``bs``: views of the plan buffer, made once per bucket."""
        views = self._bucket_views.get(("cascade", bs))
        if views is None:
            views = self._bucket_views[("cascade", bs)] = dict(zip(("suffix_start", "cascade_tiles"),
                                                                   self.cascade.views(bs)))
        return views

    def _graph_inputs(self, rows: int, state: bool) -> list[torch.Tensor]:
        """The graph buffers a decode step of bucket ``rows`` fills, ``[:rows]`` views made once per
        bucket: input ids, positions, slots, block tables, context lengths, longest-first order [, state slots]."""
        views = self._bucket_views.get(("graph", rows))
        if views is None:
            names = ["input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "decode_order",
                     "state_slots"]
            views = self._bucket_views[("graph", rows)] = [self.graph_vars[n][:rows] for n in names
                                                           if n in self.graph_vars]
        return views if state else views[:6]

    def _cascade_plan(self, host: list[np.ndarray], n: int, bs: int) -> list[np.ndarray]:
        """This step's shared-prefix plan from the host block tables / context lengths
        (``n`` real rows of bucket ``bs``), packed, as a list of 0 or 1 arrays to send with
        the step's inputs (no sharing, or cascade off: none)."""
        plan = self.cascade.plan(host[4][:n], host[5][:n], bs) if self.cascade is not None else None
        return [] if plan is None else [plan.packed().astype(np.int32, copy=False)]

    def _cascade_meta(self, packed: list[torch.Tensor], bs: int) -> dict:
        """Load the staged plan (device copy, ordered on the stream) into the cascade
        buffer; the metadata fields for cascade decode, or ``{}`` for plain decode."""
        if not packed:
            return {}
        self.cascade.buf[:packed[0].numel()].copy_(packed[0])
        return self._cascade_views(bs)

    @staticmethod
    def _logit_ends(batch: ScheduledBatch) -> np.ndarray:
        """[len(logit_seqs)] int64: the packed index of each logit seq's last scheduled token."""
        done = {id(s) for s in batch.logit_seqs}
        ends = np.cumsum([s.num_scheduled_tokens for s in batch.seqs]) - 1
        return ends[[id(s) in done for s in batch.seqs]].astype(np.int64)

    # ---- step ----------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's host arrays (rank 0 only: it reads the scheduler's sequences)."""
        sampling, use_filter = [], False
        if batch.sample_seqs:
            sampling, use_filter = self._sample_arrays(batch)
            if batch.is_prefill:  # forked siblings repeat their parent's row
                sampling.append(np.asarray(batch.sample_rows, dtype=np.int64))
        copies = self._copy_arrays(batch.copies)  # sent with the step's inputs, like every host array
        state_copies = fork_slots(batch) if self.state_pool is not None else []
        common = dict(num_sampling=len(sampling), use_filter=use_filter,
                      copy_tokens=max((c[2] for c in batch.copies), default=0),
                      max_src=-1 if batch.is_prefill else max(batch.input_src, default=-1),
                      pending_all=not batch.is_prefill and min(batch.input_src, default=-1) >= 0,
                      state_copies=bool(state_copies))
        copies = copies + state_copies
        if batch.is_prefill or not self.is_cuda:
            inputs, shape = self._gathered_inputs(batch)
            state = self._state_arrays(batch, 0)
            inputs = inputs[:-1] + state + inputs[-1:]  # the logit ends stay last
            return StepInputs(inputs + sampling + copies, len(inputs), gathered=shape, num_state=len(state), **common)
        n = len(batch.seqs)
        bs = min((b for b in self.graphs if b >= n), default=None)
        rows = n if bs is None else bs
        inputs = self._decode_paged_inputs(batch, rows)
        plan = self._cascade_plan(inputs, n, rows)
        state = self._state_arrays(batch, rows)
        inputs = inputs + state + plan
        return StepInputs(inputs + sampling + copies, len(inputs), paged_rows=rows, real_rows=n,
                          graphed=bs is not None, num_state=len(state), **common)

    def _state_arrays(self, batch: ScheduledBatch, rows: int) -> list[np.ndarray]:
        """Hybrid models: the step's recurrent-state host arrays (``state_host_arrays``; a GPU
        prefill through FLA's varlen kernel also sends its packed metadata); else none."""
        if self.state_pool is None:
            return []
        return state_host_arrays(batch, rows, self.state_pool.scratch, self.packed_state_prefill and not rows)

    def forward(self, step: StepInputs, inputs: list[torch.Tensor], sampling: bool = False) -> Optional[torch.Tensor]:
        """Hidden states ``[len(logit_seqs), hidden]`` of the step's logit rows, from its
        ``inputs`` on the device (called by ``execute``, under its inference mode). ``sampling``
        (a graphed decode, ``_samples_in_graph``): the bucket's sampling graph; returns None."""
        if not step.paged_rows:
            ids, pos, src, *meta_arrays, ends = inputs
            k = len(meta_arrays) - step.num_state
            meta = gathered_metadata(*meta_arrays[:k], step.gathered)
            attach_state(meta, meta_arrays[k:])
            return self.model(self._resolve_ids(ids, src, step.max_src, step.pending_all), pos, meta)[ends]
        ids, pos, slots, src, bt, ctx, order, *rest = inputs
        ids = self._resolve_ids(ids, src, step.max_src, step.pending_all)
        rows, n = step.paged_rows, step.real_rows
        state_slots = rest[0] if step.num_state else None
        cascade = self._cascade_meta(rest[step.num_state:], rows)
        if not step.graphed:  # eager paged decode (no graphs, or batch above the largest)
            meta = AttentionMetadata(slot_mapping=slots, block_tables=bt, context_lens=ctx, longest_first=order,
                                     paged_decode=True, state_slots=state_slots, **cascade)
            return self.model(ids, pos, meta)
        sources = (ids, pos, slots, bt, ctx, order) + ((state_slots,) if step.num_state else ())
        for dst, t in zip(self._graph_inputs(rows, bool(step.num_state)), sources):
            dst.copy_(t)
        graphs = self.sampling_graphs[bool(cascade)] if sampling else self.cascade_graphs if cascade else self.graphs
        graphs[rows].replay()
        return None if sampling else self.graph_vars["hidden"][:n]

    def launch(self, batch: ScheduledBatch):
        """Queue one step on the device (``prepare`` + ``execute``; TP: every rank runs it).
        Returns a handle for ``fetch`` without waiting for the device."""
        step = self.prepare(batch)
        if self.followers is not None:
            self.followers.run_step(step)
        return self.execute(step)

    @torch.inference_mode()
    def execute(self, step: StepInputs):
        """Inputs, forward, forked-block copies, LM head, sampling, and the asynchronous copy
        of the sampled tokens/log-probs to the host; returns a handle for ``fetch`` (None when
        no row samples, and on TP ranks other than 0). The sampled tokens stay on the device
        as ``last_tokens`` (the next step's pending input ids)."""
        arrays = self.h2d.put(step.arrays)
        k, m = step.num_inputs, step.num_inputs + step.num_sampling
        if self._samples_in_graph(step):
            return self._execute_sampling_graph(step, arrays)
        hidden = self.forward(step, arrays[:k])
        self._copy_forked(step, arrays[m:])
        if not step.num_sampling:  # a prefill chunk that completes no sequence
            self.last_tokens = None
            return None
        floats, ints = arrays[k], arrays[k + 1]
        if self.sampler.fast is None or step.use_filter:
            # fresh tensors (not views at step-dependent offsets of the staging buffer) so the
            # compiled sampler's guards see the same layout every step (the one-pass kernel has none)
            floats, ints = floats.clone(), ints.clone()
        if step.num_sampling == 3:  # prefill: the sample rows
            hidden = hidden[arrays[k + 2]]
        tokens, logprobs = self.sample(hidden, floats, ints, step.use_filter)
        self.last_tokens = tokens
        return None if logprobs is None else self.d2h.start(tokens, logprobs)

    def _samples_in_graph(self, step: StepInputs) -> bool:
        """A graphed decode step whose rows the one-pass sampler takes (no top-k / top-p), with no
        forked copies, on an engine with sampling graphs (``EngineConfig.decode_graph_sampler``)."""
        return (self.graph_sampler and step.graphed and step.num_sampling == 2 and not step.use_filter
                and not step.copy_tokens and not step.state_copies)

    def _execute_sampling_graph(self, step: StepInputs, arrays: list[torch.Tensor]):
        """``execute`` of a ``_samples_in_graph`` step: the rows' temperatures and noise keys into
        the graph's buffers, the bucket's sampling graph, the packed tokens' read-back started."""
        g, k, n = self.graph_vars, step.num_inputs, step.real_rows
        g["temp"][:n].copy_(arrays[k][0])
        g["keys"][:n].copy_(arrays[k + 1][0])
        self.forward(step, arrays[:k], sampling=True)
        self.sampling_graph_steps += 1
        self.last_tokens = g["tokens"][:n]
        return self.d2h.start_packed(g["sampled"][:2 * step.paged_rows], n)

    def _copy_forked(self, step: StepInputs, copies: list[torch.Tensor]) -> None:
        """After the forward: forked partial KV blocks (the first two arrays, if any), then
        forked recurrent states (the last two, hybrid models)."""
        if step.copy_tokens:
            self.copy_blocks(step.copy_tokens, *copies[:2])
        if step.state_copies:
            self.state_pool.copy(*copies[-2:])

    def fetch(self, handle) -> tuple[list[int], list[float]]:
        """Host lists (tokens, log-probs) of a launched step: waits for that step only."""
        if handle is None:
            return [], []
        return self.d2h.read(handle)

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        """One step, not overlapped: launch and wait for its tokens."""
        return self.fetch(self.launch(batch))

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
               use_filter: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """LM head on ``hidden`` [S, H] (one row per sample seq), then one token (and its
        log-prob) per row, on the device: tokens ``[S]`` int64, logprobs ``[S]`` fp32.
        TP: rank 0 samples from the gathered full-vocabulary logits and broadcasts the
        tokens; the other ranks get the tokens and no log-probs (None)."""
        if self.tp.size == 1 and self.sampler.fast is not None and not use_filter:
            return self._sample_unfiltered(hidden, floats[0], ints[0])
        logits = self.model.lm_head(hidden)  # cast to fp32 inside the (fused) sampler
        if self.tp.size == 1:
            return self.sampler(logits, floats, ints, use_filter)
        full = self.tp.comm.gather_columns(logits, self.model.config.vocab_size)
        if full is None:
            return self.tp.comm.broadcast(torch.empty(hidden.shape[0], dtype=torch.int64, device=self.device)), None
        tokens, logprobs = self.sampler(full, floats, ints, use_filter)
        return self.tp.comm.broadcast(tokens), logprobs
