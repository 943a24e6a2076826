"""One dense decoder covering Qwen3 (q/k RMSNorm), Qwen2/2.5 (q/k/v bias) and Llama.

Tokens are packed: every forward takes ``input_ids [T]`` and ``positions [T]`` for all
sequences of the step concatenated, and an ``AttentionMetadata`` that says which cached
keys each token sees. Projections are fused (``qkv_proj``, ``gate_up_proj``): one GEMM
instead of three/two per layer, which matters at decode batch sizes.

HF parameter names are mapped onto the fused ones by ``load_weights`` (also used by
``LLM.update_weights``): ``q_proj/k_proj/v_proj -> qkv_proj`` and
``gate_proj/up_proj -> gate_up_proj``, each copied into its row slice in place, so the
parameter storage (and any CUDA graph captured over it) stays valid.

Tensor parallelism (``tp``, ``engine/parallel/``): the projections are the column/row-parallel
layers, embedding and head split the vocabulary; every loader takes the FULL HF tensor and
keeps this rank's slice. With ``tp.size == 1`` they are the plain torch layers.
"""
from __future__ import annotations

import functools
import os
import types
from typing import Hashable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engine.attention import AttentionMetadata, attend_cached, paged_attention, take_rows
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.parallel.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                            RowParallelLinear, VocabParallelEmbedding, load_replicated)
from asyncrl.engine.parallel.layout import SINGLE, TensorParallel


class _CudaCompiled:
    """Calls ``fn`` eagerly on CPU and through ``torch.compile`` on CUDA, where fusing a
    layer's elementwise glue (norms, RoPE, SiLU) into a few kernels shortens both the
    GPU time and the CUDA graph (ASYNCRL_ENGINE_COMPILE=0 turns it off).

    One compiled copy of ``fn`` per dtype signature of the tensor arguments and grad mode, each
    with its own code object: dynamo keeps its graphs and its recompile budget (8) per code
    object, and a process that calls ``fn`` in several dtypes and modes (an fp32 draft head
    trained and replayed beside a bf16 engine) once exhausted the shared budget, after which dynamo ran ``fn`` eagerly: workload
    (a) fell from 47k to 28k tok/s on an H200 (bench/RESULTS.md, 2026-12-02)."""

    device_types = ("cuda",)  # where it compiles (tests add "cpu")
    compile_options: dict = {}  # extra torch.compile arguments (tests: backend="eager")

    def __init__(self, fn):
        self.fn = fn
        self.variants: dict[tuple, object] = {}
        self.enabled = os.environ.get("ASYNCRL_ENGINE_COMPILE", "1") != "0"

    def __call__(self, x, *args):
        # is_cuda / is_cpu are flags; x.device builds an object (this runs ~100 times per step)
        kind = "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type
        if not (self.enabled and kind in self.device_types):
            return self.fn(x, *args)
        return self.variant((x, *args))(x, *args)

    def variant(self, args: tuple):
        """The compiled copy for ``args``' tensor dtypes and the grad mode (built on first use)."""
        key = (*(a.dtype for a in args if isinstance(a, torch.Tensor)), torch.is_grad_enabled())
        compiled = self.variants.get(key)
        if compiled is None:
            tag = "_".join(str(d).removeprefix("torch.") for d in key)
            code = self.fn.__code__.replace(co_name=f"{self.fn.__name__}__{tag}")
            copy = types.FunctionType(code, self.fn.__globals__, code.co_name, self.fn.__defaults__)
            compiled = self.variants[key] = torch.compile(copy, dynamic=True, **self.compile_options)
        return compiled


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight``, in fp32 then back, like HF."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(x + residual), x + residual): the residual add fused into the norm."""
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def _qkv_prepare(qkv, positions, cos_table, sin_table, q_norm_w, k_norm_w, eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv ``[T, (H + 2 Hkv) D]`` -> q ``[T, H, D]``, k, v ``[T, Hkv, D]``, with the optional
    per-head q/k RMSNorm (Qwen3) and RoPE applied to q and k."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(T, num_heads, head_dim)
    k = k.reshape(T, num_kv_heads, head_dim)
    v = v.reshape(T, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q, k = _rms_norm(q, q_norm_w, eps), _rms_norm(k, k_norm_w, eps)
    cos = take_rows(cos_table, positions).unsqueeze(1)
    sin = take_rows(sin_table, positions).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def _silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


rms_norm = _CudaCompiled(_rms_norm)
add_rms_norm = _CudaCompiled(_add_rms_norm)
qkv_prepare = _CudaCompiled(_qkv_prepare)
silu_and_mul = _CudaCompiled(_silu_and_mul)

# CUDA: SwiGLU through triton_silu's tiled kernel instead of the compiled ``silu_and_mul`` (Inductor's
# kernel read a prefill's rows at ~1.6 TB/s on an H200; bench/glue_kernels.py). Read when the MLP runs, so
# an engine's CUDA graphs keep the choice made at capture; benchmarks flip it to compare.
TRITON_SILU = True
# CUDA: RMSNorm (and the residual add before it) of [T, N] rows through triton_norm's kernel: whole rows per
# program, fewer and wider programs than Inductor's at a decode step's few hundred rows (bench/glue_kernels.py)
TRITON_NORM = True
# CUDA, decode-sized batches: the layer's GEMMs as triton_gemm's kernels with the residual adds, RMSNorms, SwiGLU and
# (TRITON_GEMM_QKV) the q/k norm + RoPE + K/V write inside them (five kernels a layer instead of nine). None (default):
# on where it was measured faster end to end, a CUDA device of compute capability 9.x (Hopper) with FOLD_NORMS (1.023x
# at workload (a) on an H100, every interleaved repeat >= 1.02x; without the folding 0.93x: bench/RESULTS.md, issue
# 23); True: forced (any CUDA device with TMA, or the Triton interpreter: tests); False: off. Read at each forward, so
# CUDA graphs keep the choice made at capture.
TRITON_GEMM: Optional[bool] = None
# With TRITON_GEMM and the fused K/V write: the q/k norm + RoPE + K/V write in the qkv GEMM's epilogue (five kernels a
# layer); off: triton_qkv's own kernel after the GEMM (benchmarks flip it to time the epilogue alone)
TRITON_GEMM_QKV = True
# With TRITON_GEMM: each RMSNorm weight folded into the projection after it (``triton_gemm.fold_norm``: W diag(w), kept
# per layer and re-folded in place on every weight load), so qkv and gate_up run as plain TMA GEMMs with the row scale
# in their epilogues instead of building the normed rows in registers (the prologue that doubled them). Another
# rounding of the same product, not the engine's / HF's roundings (the log-prob mismatch against HF measured unchanged,
# 0.00737 vs 0.00735); costs a second copy of those two weights (~0.6 GB at 0.6B, ~9 GB at 8B), made before the KV
# pool is sized so the pool leaves room for it (``DecoderModel.prepare_fused_gemms``).
FOLD_NORMS = True
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the Triton interpreter runs the kernels on CPU (tests)


def fused_gemms_enabled(device: torch.device) -> bool:
    """Whether ``TRITON_GEMM`` sends decode-sized forwards on ``device`` through ``triton_gemm`` (see the flag)."""
    if TRITON_GEMM is None:
        return FOLD_NORMS and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return TRITON_GEMM and (device.type == "cuda" or _INTERPRET)


def swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of a gate_up projection ``[T, 2 inter]`` -> ``[T, inter]``."""
    if gate_up.is_cuda and TRITON_SILU:
        from asyncrl.engine.triton_silu import silu_and_mul as triton_silu_and_mul  # Triton: only where it runs
        return triton_silu_and_mul(gate_up, inter)
    return silu_and_mul(gate_up, inter)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if x.is_cuda and TRITON_NORM and x.dim() == 2 and self.weight.dtype == x.dtype:
            from asyncrl.engine.triton_norm import rms_norm as triton_rms_norm  # Triton: only where it runs
            return triton_rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables for all positions: ``cos, sin: [max_pos, D]`` (fp32)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv = config.inv_freq()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class Attention(nn.Module):
    """This rank's ``H/tp`` query heads and ``max(1, Hkv/tp)`` KV heads (all of them at tp = 1)."""

    def __init__(self, c: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_heads, self.num_kv_heads = tp.heads(c.num_attention_heads), tp.kv_heads(c.num_key_value_heads)
        self.head_dim = c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                          c.qkv_bias, tp)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        # set by ModelRunner.allocate_kv_cache: [num_blocks + 1, block_size, Hkv, D]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # set by ModelRunner (EngineConfig.fused_kv_write, CUDA only): q/k norm + RoPE and the K/V cache
        # write in one Triton kernel (triton_qkv.py) instead of the compiled glue + store_kv
        self.fused_kv_write = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), positions, rope, meta))

    def qk_norm_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The per-head q and k RMSNorm weights ``[D]`` (Qwen3), or (None, None)."""
        if self.q_norm is None:
            return None, None
        return self.q_norm.weight, self.k_norm.weight

    def attend_normed(self, h: torch.Tensor, ss: torch.Tensor, norm: "RMSNorm", positions: torch.Tensor,
                      rope: RotaryEmbedding, meta: AttentionMetadata,
                      folded: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``attend(qkv_proj(norm(h)))`` with the norm in the qkv GEMM's prologue (``triton_gemm``; ``ss [T, P]``:
        h's row sums of squares in partials; ``folded``: the qkv weight with the norm's weight folded in, the row
        scale in the epilogue instead) and, where the K/V write is fused (``fused_kv_write``) and
        ``TRITON_GEMM_QKV`` is on, the q/k norm + RoPE + cache write in its epilogue -> ``[T, H D]``."""
        from asyncrl.engine import triton_gemm  # Triton: only where it runs

        weight = self.qkv_proj.weight if folded is None else folded
        fold = dict(folded=folded is not None, bias=self.qkv_proj.bias)
        if not (self.fused_kv_write and TRITON_GEMM_QKV and triton_gemm.qkv_epilogue_fits(self.head_dim)):
            qkv = triton_gemm.norm_linear(h, ss, norm.weight, weight, norm.eps, **fold)
            return self.attend(qkv, positions, rope, meta)
        qn, kn = self.qk_norm_weights()
        q = triton_gemm.norm_qkv_to_cache(h, ss, norm.weight, weight, norm.eps, positions, rope.cos, rope.sin, qn, kn,
                                          self.eps, self.num_heads, self.num_kv_heads, self.head_dim, self.k_cache,
                                          self.v_cache, meta.slot_mapping, **fold)
        return attend_cached(q, self.k_cache, self.v_cache, meta, self.scale).reshape(h.shape[0], self.q_size)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
               meta: AttentionMetadata) -> torch.Tensor:
        """The qkv projection's output ``[T, (H + 2 Hkv) D]`` -> attention's output ``[T, H D]`` (before o_proj):
        q/k norm + RoPE, this step's K/V into the cache, attention over the cached keys."""
        T = qkv.shape[0]
        qn, kn = self.qk_norm_weights()
        if self.fused_kv_write:
            from asyncrl.engine.triton_qkv import qkv_to_cache  # Triton: imported only where it runs

            q = qkv_to_cache(qkv, positions, rope.cos, rope.sin, qn, kn, self.eps, self.num_heads,
                             self.num_kv_heads, self.head_dim, self.k_cache, self.v_cache, meta.slot_mapping)
            o = attend_cached(q, self.k_cache, self.v_cache, meta, self.scale)
        else:
            q, k, v = qkv_prepare(qkv, positions, rope.cos, rope.sin, qn, kn, self.eps,
                                  self.num_heads, self.num_kv_heads, self.head_dim)
            o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return o.reshape(T, self.q_size)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.inter = c.intermediate_size // tp.size
        self.gate_up_proj = MergedColumnParallelLinear.gate_up(c.hidden_size, c.intermediate_size, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.inter))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(c, tp)
        self.mlp = MLP(c, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # (qkv, gate_up) weights with the norms before them folded in (FOLD_NORMS): made at the first folded forward
        # (a CUDA-graph warm-up runs eagerly before its capture), refolded in place by every weight load
        self._folded: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x, residual, positions, rope, meta):
        """Pre-norm block over a separate residual stream (the add fused into the norms):
        returns (mlp output, residual) with ``residual + output`` = HF's hidden state."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_fused(self, h, ss, positions, rope, meta):
        """``forward`` through ``triton_gemm``: ``h [T, hidden]`` the hidden state (residual stream included),
        ``ss [T, P]`` its row sums of squares in partials -> the next layer's (h, ss)."""
        from asyncrl.engine.triton_gemm import linear_residual, norm_linear  # Triton: only where it runs

        attn, mlp = self.self_attn, self.mlp
        qkv_w, gate_up_w = self.folded_weights() if FOLD_NORMS else (None, None)
        o = attn.attend_normed(h, ss, self.input_layernorm, positions, rope, meta, folded=qkv_w)
        h, ss = linear_residual(o, attn.o_proj.weight, h)
        norm = self.post_attention_layernorm
        act = norm_linear(h, ss, norm.weight, mlp.gate_up_proj.weight if gate_up_w is None else gate_up_w, norm.eps,
                          inter=mlp.inter, folded=gate_up_w is not None)
        return linear_residual(act, mlp.down_proj.weight, h)

    def folded_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_qkv diag(w_in), W_gate_up diag(w_post))`` (``triton_gemm.fold_norm``), made on first use."""
        if self._folded is None:
            self._folded = self._fold()
        return self._folded

    def refold(self) -> None:
        """After a weight load: the folded weights (where made) from the new weights, in place (the addresses a
        CUDA graph captured stay valid)."""
        if self._folded is not None:
            self._fold(self._folded)

    def _fold(self, out=(None, None)) -> tuple[torch.Tensor, torch.Tensor]:
        from asyncrl.engine.triton_gemm import fold_norm  # torch only, but beside its kernels

        with torch.inference_mode():
            return (fold_norm(self.self_attn.qkv_proj.weight, self.input_layernorm.weight, out[0]),
                    fold_norm(self.mlp.gate_up_proj.weight, self.post_attention_layernorm.weight, out[1]))

    def fits_fused_gemms(self, dtype: torch.dtype) -> bool:
        """Whether ``forward_fused`` computes this layer: a plain dense layer (no MoE / hybrid subclass), its four
        projections the unwrapped tp = 1 layers (no LoRA or FP8) in ``dtype`` with no bias but qkv's (Qwen2), its
        norms plain RMSNorms."""
        from asyncrl.engine.triton_gemm import launch, tma_ready

        attn, mlp = self.self_attn, self.mlp
        projections = ((attn.qkv_proj, "norm"), (attn.o_proj, "residual"), (mlp.gate_up_proj, "swiglu"),
                       (mlp.down_proj, "residual"))
        return (type(self) is DecoderLayer and type(self.input_layernorm) is RMSNorm
                and type(self.post_attention_layernorm) is RMSNorm
                and all(type(m) in (QKVParallelLinear, RowParallelLinear, MergedColumnParallelLinear)
                        and (m.bias is None or m is attn.qkv_proj) and m.tp.size == 1 and m.weight.dtype == dtype
                        and tma_ready(m.weight)
                        and launch(kind, m.in_features, m.out_features // (2 if kind == "swiglu" else 1))
                        for m, kind in projections))


class DecoderModel(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList([DecoderLayer(c, tp) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        if self.fits_fused_gemms(x):
            return self.forward_fused(x, positions, meta)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, meta)
        return self.norm(x, residual)[0]

    def fits_fused_gemms(self, x: torch.Tensor) -> bool:
        """Whether this forward takes ``forward_fused``: ``fused_gemms_enabled`` on ``x``'s device, the embedding
        ``x [T, hidden]`` with at most ``triton_gemm.MAX_ROWS`` rows, every layer fitting."""
        if not (fused_gemms_enabled(x.device) and x.dim() == 2):
            return False
        from asyncrl.engine.triton_gemm import MAX_ROWS, tma_ready

        return 0 < x.shape[0] <= MAX_ROWS and tma_ready(x) and self.layers_fit_fused_gemms(x.dtype)

    def layers_fit_fused_gemms(self, dtype: torch.dtype) -> bool:
        """Whether every layer (and the final norm) can run through ``forward_fused`` in ``dtype``."""
        return type(self.norm) is RMSNorm and all(isinstance(layer, DecoderLayer) and layer.fits_fused_gemms(dtype)
                                                  for layer in self.layers)

    def prepare_fused_gemms(self, dtype: torch.dtype, device: torch.device) -> int:
        """Make every layer's folded weights now if decode forwards will fold (``FOLD_NORMS``), so they are in memory
        before the engine sizes its KV pool from what is free: -> bytes they take (0 where nothing folds)."""
        if not (FOLD_NORMS and fused_gemms_enabled(device) and self.layers_fit_fused_gemms(dtype)):
            return 0
        return sum(w.numel() * w.element_size() for layer in self.layers for w in layer.folded_weights())

    def forward_fused(self, x, positions, meta):
        """``forward`` with every layer through ``DecoderLayer.forward_fused`` (the embedding's row sums of squares
        from torch: the first norm has no GEMM before it)."""
        from asyncrl.engine.triton_gemm import sum_squares  # Triton: only where it runs

        h, ss = x, sum_squares(x)
        for layer in self.layers:
            h, ss = layer.forward_fused(h, ss, positions, self.rotary_emb, meta)
        return self.norm(h)


# HF name fragment -> (our fused parameter fragment, shard name)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@functools.lru_cache(maxsize=1 << 16)
def _load_target(name: str) -> tuple[str, Optional[Hashable], str, str]:
    """(our parameter's name, its shard of a fused parameter or None, its module's name, the
    parameter's own name) for the HF tensor ``name``: pure string work, cached because every
    weight sync sends the same names."""
    target, shard = name, None
    for frag, (fused, fused_shard) in _PACKED.items():
        if f".{frag}." in name:
            target, shard = name.replace(f".{frag}.", f".{fused}."), fused_shard
            break
    module_name, _, param_name = target.rpartition(".")
    return target, shard, module_name, param_name


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` (fp32; under tensor parallelism on
    rank 0 only, None on the others). ``tp``: this rank's share of the model."""

    model_class = DecoderModel  # the trunk: families with other layers override it (moe.py, qwen3_5.py)
    # ``[(num_blocks + 1) * block_size, hidden]`` or None: set by a ModelRunner whose EAGLE proposer
    # drafts from the target's features; every forward writes its tokens' hidden states at their KV
    # slots (prefill, plain decode, verify alike), so the features of every cached position are there
    feature_buffer: Optional[torch.Tensor] = None

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        # only the dense trunk takes a rank's share (``splits_over_ranks``); the others build whole
        self.model = self.model_class(config, tp) if tp.size > 1 else self.model_class(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def splits_over_ranks(cls) -> bool:
        """Whether tensor parallelism can split this family: the dense trunk's layers are the
        parallel ones (engine/parallel/layers.py); families with their own trunk (MoE experts,
        Gated DeltaNet) have not adopted them yet."""
        return cls.model_class is DecoderModel

    def forward(self, input_ids, positions, meta):
        hidden = self.model(input_ids, positions, meta)
        if self.feature_buffer is not None:  # rows of ``hidden`` and of the slot mapping align on every path
            self.feature_buffer.index_copy_(0, meta.slot_mapping, hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = self.lm_head(hidden)
        if self.tp.size > 1:
            logits = self.tp.comm.gather_columns(logits, self.config.vocab_size)
        return None if logits is None else logits.float()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full HF-named tensors into our (fused, maybe TP-sliced) parameters in place;
        returns #loaded. Each parameter's module slices its part (``weight_loader``); modules
        without one (norms) are replicated.

        Unknown names raise: a silently skipped tensor would leave stale weights.
        """
        # one walk of the module tree per load gives both maps (not get_submodule per tensor, nor
        # a second walk for named_parameters: on the CPU quickstart's tiny model the walks were
        # most of a sync's time); fresh each call, as FP8 and LoRA replace modules after build
        modules = dict(self.named_modules(remove_duplicate=False))
        params = {f"{prefix}.{key}" if prefix else key: param for prefix, module in modules.items()
                  for key, param in module._parameters.items() if param is not None}
        n = 0
        for name, tensor in named_tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: embed_tokens.weight carries it
            target, shard, module_name, param_name = _load_target(name)
            if target not in params:
                raise KeyError(f"no parameter for checkpoint tensor {name!r}")
            loader = getattr(modules[module_name], "weight_loader", None)
            if loader is None:
                load_replicated(params[target], tensor, name)
            else:
                loader(param_name, tensor, shard, name)
            n += 1
        for module in modules.values():  # FOLD_NORMS' copies follow the weights just loaded
            if isinstance(module, DecoderLayer):
                module.refold()
        return n
