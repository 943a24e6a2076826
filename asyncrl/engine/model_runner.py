"""ModelRunner: owns the model, the KV pool and the CUDA graphs; runs one step.

``run(batch)`` = prepare inputs -> forward (graph replay for GPU decode) -> copy forked
partial blocks -> logits of the rows that sample -> sample. It returns host lists, the
one device->host sync per step.

KV pool: per layer ``[num_blocks + 1, block_size, Hkv, D]``; block ``num_blocks`` is the
scratch block that padded rows write to (never handed out by the BlockManager).
"""
from __future__ import annotations

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, build_gathered_metadata
from asyncrl.engine.cascade import CascadeBuffers
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.models.decoder import CausalLM
from asyncrl.engine.sampler import Sampler, row_keys
from asyncrl.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, max_model_len: int):
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.is_cuda = self.device.type == "cuda"
        self.num_blocks = self._num_kv_blocks()
        self.scratch_block = self.num_blocks
        self._allocate_kv_cache()
        self.sampler = Sampler(self.device, compile=config.compile_sampler)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # shared-prefix (cascade) decode: plan buffers + a second graph per bucket
        c = model.config
        self.cascade = (CascadeBuffers(c.num_attention_heads, c.num_key_value_heads, self.block_size,
                                       config.max_num_seqs, self.device)
                        if self.is_cuda and config.cascade_attention else None)
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.is_cuda and not config.enforce_eager:
            self._capture_cudagraphs()

    # ---- KV cache --------------------------------------------------------------
    def _block_bytes(self) -> int:
        c = self.model.config
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        """Explicit, else enough for max_num_seqs full-length sequences, capped by memory
        (GPU: free memory x utilisation minus activation headroom; CPU: kv_memory_gb_cpu)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        want = self.config.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        if self.is_cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info(self.device)
            # headroom for activations: prefill of the token budget through the gathered
            # path and the fp32 logits of a full decode batch
            c = self.model.config
            act = self.config.max_num_batched_tokens * (c.hidden_size + c.intermediate_size) * 2 * 4 * 4
            act += self.config.max_num_seqs * c.vocab_size * 4 * 6
            budget = free - total * (1 - self.config.gpu_memory_utilization) - act
            return max(16, min(want, int(budget // self._block_bytes())))
        cap = int(self.config.kv_memory_gb_cpu * 2**30 // self._block_bytes())
        return max(16, min(want, cap))

    def _allocate_kv_cache(self) -> None:
        c = self.model.config
        shape = (self.num_blocks + 1, self.block_size, c.num_key_value_heads, c.head_dim)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Free the KV pool and CUDA graphs (the engine is unusable afterwards)."""
        self.graphs.clear()
        self.cascade_graphs.clear()
        self.graph_vars = {}
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = torch.empty(0)
            layer.self_attn.v_cache = torch.empty(0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.model.model.layers:
            attn = layer.self_attn
            attn.k_cache[dst] = attn.k_cache[src]
            attn.v_cache[dst] = attn.v_cache[src]

    # ---- inputs ----------------------------------------------------------------
    def _prepare(self, batch: ScheduledBatch):
        ids, pos = [], []
        for s in batch.seqs:
            a, n = s.num_cached_tokens, s.num_scheduled_tokens
            ids.extend(s.token_ids[a:a + n])
            pos.extend(range(a, a + n))
        meta = build_gathered_metadata([s.block_table for s in batch.seqs],
                                       [s.num_cached_tokens for s in batch.seqs],
                                       [s.num_scheduled_tokens for s in batch.seqs],
                                       self.block_size, self.scratch_block, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, meta

    def _decode_paged_inputs(self, batch: ScheduledBatch, bs: int):
        """Host tensors for a paged decode of ``bs`` rows (real seqs, then padding rows
        that write the scratch block and attend one scratch token)."""
        bsz = self.block_size
        ids = np.zeros(bs, dtype=np.int64)
        pos = np.zeros(bs, dtype=np.int64)
        slots = np.full(bs, self.scratch_block * bsz, dtype=np.int64)
        bt = np.full((bs, self._bt_width()), self.scratch_block, dtype=np.int32)
        ctx = np.ones(bs, dtype=np.int32)
        for i, s in enumerate(batch.seqs):
            p = len(s) - 1
            ids[i], pos[i], ctx[i] = s.token_ids[p], p, p + 1
            slots[i] = s.block_table[p // bsz] * bsz + p % bsz
            bt[i, : len(s.block_table)] = s.block_table
        return tuple(torch.from_numpy(a) for a in (ids, pos, slots, bt, ctx))

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
            hidden=torch.zeros(max_bs, c.hidden_size, dtype=self.dtype, device=self.device),
        )
        pool = None
        variants = [(self.graphs, lambda bs: {})]
        if self.cascade is not None:
            variants.append((self.cascade_graphs, self._cascade_views))
        for bs in reversed(sizes):
            for graphs, extra in variants:
                meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:bs], block_tables=g["block_tables"][:bs],
                                         context_lens=g["context_lens"][:bs], paged_decode=True, **extra(bs))
                args = (g["input_ids"][:bs], g["positions"][:bs], meta)
                g["hidden"][:bs] = self.model(*args)  # warmup (Triton compile, allocator)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    g["hidden"][:bs] = self.model(*args)
                pool = graph.pool() if pool is None else pool
                graphs[bs] = graph
                torch.cuda.synchronize()

    def _cascade_views(self, bs: int) -> dict:
        return dict(zip(("suffix_start", "cascade_tiles"), self.cascade.views(bs)))

    def _cascade_meta(self, bt: torch.Tensor, ctx: torch.Tensor, n: int, bs: int) -> dict:
        """Plan this step's shared prefixes from the host block tables / context lengths
        (``[bs, W]`` / ``[bs]``, ``n`` real rows); load it and return the metadata fields,
        or ``{}`` for plain paged decode (no sharing, or cascade off)."""
        plan = self.cascade.plan(bt.numpy()[:n], ctx.numpy()[:n], bs) if self.cascade is not None else None
        if plan is None:
            return {}
        self.cascade.load(plan, bs)
        return self._cascade_views(bs)

    # ---- step ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Hidden states of the ``batch.logit_seqs`` rows: ``[len(logit_seqs), hidden]``."""
        if batch.is_prefill or not self.is_cuda:
            input_ids, positions, meta = self._prepare(batch)
            hidden = self.model(input_ids, positions, meta)
            done = {id(s) for s in batch.logit_seqs}
            ends, off = [], 0
            for s in batch.seqs:
                off += s.num_scheduled_tokens
                if id(s) in done:
                    ends.append(off - 1)
            return hidden[torch.tensor(ends, dtype=torch.long, device=self.device)]
        n = len(batch.seqs)
        bs = min((b for b in self.graphs if b >= n), default=None)
        if bs is None:  # eager paged decode (no graphs, or batch above the largest)
            host = self._decode_paged_inputs(batch, n)
            ids, pos, slots, bt, ctx = (t.to(self.device, non_blocking=True) for t in host)
            meta = AttentionMetadata(slot_mapping=slots, block_tables=bt, context_lens=ctx, paged_decode=True,
                                     **self._cascade_meta(host[3], host[4], n, n))
            return self.model(ids, pos, meta)
        g = self.graph_vars
        ids, pos, slots, bt, ctx = self._decode_paged_inputs(batch, bs)
        g["input_ids"][:bs].copy_(ids, non_blocking=True)
        g["positions"][:bs].copy_(pos, non_blocking=True)
        g["slot_mapping"][:bs].copy_(slots, non_blocking=True)
        g["block_tables"][:bs].copy_(bt, non_blocking=True)
        g["context_lens"][:bs].copy_(ctx, non_blocking=True)
        graphs = self.cascade_graphs if self._cascade_meta(bt, ctx, n, bs) else self.graphs
        graphs[bs].replay()
        return g["hidden"][:n]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        hidden = self.forward(batch)
        self.copy_blocks(batch.copies)
        return self.sample(batch, hidden)

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, hidden: torch.Tensor) -> tuple[list[int], list[float]]:
        """LM head on the logit rows, then one token (and its log-prob) per sample seq."""
        if not batch.sample_seqs:  # a prefill chunk that completes no sequence
            return [], []
        if batch.is_prefill:  # forked siblings repeat their parent's row
            hidden = hidden[torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.lm_head(hidden)  # cast to fp32 inside the (fused) sampler
        seqs = batch.sample_seqs
        floats = np.array([[s.params.temperature for s in seqs], [s.params.top_p for s in seqs]], dtype=np.float32)
        keys = row_keys(np.array([s.seed for s in seqs], dtype=np.int64),
                        np.array([s.sample_index for s in seqs], dtype=np.int64),
                        np.array([len(s) for s in seqs], dtype=np.int64))
        ints = np.stack([keys, np.array([s.params.top_k for s in seqs], dtype=np.int64)])
        use_filter = any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs)
        d = self.device
        tokens, logprobs = self.sampler(logits, torch.from_numpy(floats).to(d, non_blocking=True),
                                        torch.from_numpy(ints).to(d, non_blocking=True), use_filter)
        # one device->host transfer for both (token ids < 2^53 are exact in fp64)
        out = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).tolist()
        return [int(t) for t in out[0]], out[1]
