"""Qwen3.5 (dense and MoE): a hybrid decoder of Gated DeltaNet and gated full-attention layers.

``layer_types[i]`` is ``linear_attention`` (Gated DeltaNet, GDN) or ``full_attention`` (3:1 in
the released models). What differs from the dense decoder (transformers ``qwen3_5`` /
``qwen3_5_moe``, SCALE.md §3.1):

* norms are zero-centred: ``norm(x) * (1 + w)`` computed in fp32, then cast;
* full attention: ``q_proj`` gives per head ``[q | gate]``; q/k RMSNorm per head; RoPE on the
  first ``head_dim * partial_rotary_factor`` dims only; the output is ``attn * sigmoid(gate)``;
* GDN: a depthwise causal conv (kernel 4, SiLU) over the q/k/v channels, then the gated delta
  rule ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``
  (q, k L2-normalised, q scaled by K^-1/2; v-heads share k-heads), ``RMSNormGated(o, z)``, ``out_proj``.

The GDN layers carry per-sequence state instead of K/V: the last ``kernel - 1`` conv inputs and
the ``[HV, K, V]`` delta-rule state (fp32, or ``mamba_ssm_cache_dtype``), in slot
``seq.table_row`` of a ``StatePool`` (``state_pool.py``), read and written in place every step.
Only the full-attention layers have a paged K/V cache. Projections are fused like the dense
decoder's: ``qkv_proj`` (q+gate, k, v), ``in_proj`` (qkv, z, b, a), ``gate_up_proj``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engine.attention import AttentionMetadata, paged_attention
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import MLP, CausalLM, DecoderModel, RotaryEmbedding, _CudaCompiled
from asyncrl.engine.models.gated_delta import causal_conv_packed, causal_conv_step, causal_conv_varlen, \
    fla_conv_available, gated_delta_decode, gated_delta_prefill, gated_delta_prefill_packed
from asyncrl.engine.models.moe import SparseMoeBlock, expert_units, load_expert_tensor, moe_block, num_experts


# The elementwise glue below (norms, gates, partial RoPE) goes through ``torch.compile`` on CUDA,
# as the dense decoder's does (``decoder._CudaCompiled``): a few fused kernels per layer instead of
# ~10 each, which shortens the decode CUDA graph and its GPU time; eager on CPU.
def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm(x) * (1 + w)`` in fp32, cast back (``Qwen3_5RMSNorm``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def _add_zero_centred_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(x + residual), x + residual)."""
    residual = x + residual
    return zero_centred_rms_norm(residual, weight, eps), residual


def _gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * norm(o) * silu(z)`` (``Qwen3_5RMSNormGated``: the norm cast to o's dtype before the
    weight, the gate in fp32)."""
    dtype = o.dtype
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * of.to(dtype) * F.silu(z.float())).to(dtype)


def _gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(beta = sigmoid(b) in the model dtype then fp32, as transformers; log-decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32), both ``[.., HV]``."""
    beta = torch.sigmoid(b).float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return beta, g


def _qk_norm_rope(q, k, positions, cos_table, sin_table, q_w, k_w, eps: float):
    """Per-head zero-centred q/k norms, then RoPE on the first ``cos_table.shape[-1]`` dims."""
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    q, k = zero_centred_rms_norm(q, q_w, eps), zero_centred_rms_norm(k, k_w, eps)
    return _rotate_partial(q, cos, sin).contiguous(), _rotate_partial(k, cos, sin).contiguous()


zc_norm = _CudaCompiled(zero_centred_rms_norm)
add_zc_norm = _CudaCompiled(_add_zero_centred_rms_norm)
gated_norm = _CudaCompiled(_gated_rms_norm)
gdn_gates = _CudaCompiled(_gdn_gates)
qk_norm_rope = _CudaCompiled(_qk_norm_rope)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return zc_norm(x, self.weight, self.eps)
        return add_zc_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """``w * norm(o) * silu(z)`` per v-head (``Qwen3_5RMSNormGated``: the norm cast to o's dtype
    before the weight, the gate in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_norm(o, z, self.weight, self.eps)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) on the first ``cos.shape[-1]`` dims of ``x [T, H, D]``; the rest pass."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    half = rd // 2
    rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat(((xr * cos + rot * sin).to(x.dtype), xp), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate; K/V in the paged cache (``k_cache``/``v_cache``)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(c.extra.get("attention_bias", False))
        self.qkv_proj = nn.Linear(c.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.k_cache = torch.empty(0)  # [num_blocks + 1, block_size, Hkv, D] (ModelRunner)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # per head [q | gate]
        q, k = qk_norm_rope(q, k.reshape(T, self.num_kv_heads, self.head_dim), positions, rope.cos, rope.sin,
                            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        o = paged_attention(q, k, v.reshape(T, self.num_kv_heads, self.head_dim),
                            self.k_cache, self.v_cache, meta, self.scale)
        o = o.reshape(T, self.q_size) * torch.sigmoid(gate.reshape(T, self.q_size))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer. ``conv_state [slots, C, kernel - 1]`` and ``ssm_state [slots, HV, K, V]``
    (fp32 unless ``mamba_ssm_cache_dtype``) are this layer's views of the ``StatePool``;
    ``meta.state_slots [B]`` says which slot each sequence of the step owns."""

    # packed prefill steps (GPU + FLA): the conv through FLA's varlen kernel; False keeps the torch
    # conv over the padded batch (the A/B of bench/qwen35_levers.py)
    packed_conv = True

    def __init__(self, c: ModelConfig):
        super().__init__()
        x = c.extra
        self.num_k_heads, self.num_v_heads = x["linear_num_key_heads"], x["linear_num_value_heads"]
        self.head_k_dim, self.head_v_dim = x["linear_key_head_dim"], x["linear_value_head_dim"]
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = x.get("linear_conv_kernel_dim", 4)
        self.in_proj = nn.Linear(c.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def _split(self, x: torch.Tensor):
        """in_proj -> (qkv [.., C], z [.., Vd], beta [.., HV] fp32, g [.., HV] fp32 log-decay)."""
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        beta, g = gdn_gates(b, a, self.A_log, self.dt_bias)
        return qkv, z, beta, g

    def _heads(self, qkv: torch.Tensor):
        """[..., C] -> q, k [..., Hk, K], v [..., HV, V]."""
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = qkv.shape[:-1]
        qk_shape = (*lead, self.num_k_heads, self.head_k_dim)
        return q.reshape(qk_shape), k.reshape(qk_shape), v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv, z, beta, g = self._split(x)
        weight = self.conv1d.weight.squeeze(1)  # [C, kernel]
        if meta.q_index is None:  # paged decode: one token per sequence, in place in the slots
            slots = meta.state_slots
            qkv = causal_conv_step(qkv, self.conv_state, slots, weight)
            q, k, v = self._heads(qkv)
            o = gated_delta_decode(q, k, v, g, beta, self.ssm_state, slots)
        elif meta.state_cu_seqlens is not None:  # GPU prefill: FLA's varlen kernels on the packed tokens
            o = self._prefill_packed(qkv, g, beta, weight, meta)
        else:  # gathered (CPU, or no FLA): the conv and the recurrence over sequences padded to [B, Lq]
            o = self._prefill_padded(qkv, g, beta, weight, meta)
        o = self.norm(o.to(x.dtype), z.reshape(T, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _prefill_packed(self, qkv, g, beta, weight, meta) -> torch.Tensor:
        """qkv ``[T, C]`` of the step's packed tokens -> o ``[T, HV, V]``: one FLA conv call and one
        FLA chunked delta-rule call for all the step's sequences (``cu_seqlens``)."""
        init, slots, cu, chunks = meta.state_init, meta.state_slots, meta.state_cu_seqlens, meta.state_chunk_indices
        if self.packed_conv and fla_conv_available():
            qkv = causal_conv_packed(qkv, cu, chunks, self.conv_state, slots, init, weight)
        else:
            qkv = causal_conv_varlen(qkv[meta.q_index], meta.state_lens, self.conv_state, slots, init,
                                     weight).flatten(0, 1)[meta.q_out_index]
        q, k, v = self._heads(qkv)
        return gated_delta_prefill_packed(q, k, v, g, beta, cu, chunks, self.ssm_state, slots, init)

    def _prefill_padded(self, qkv, g, beta, weight, meta) -> torch.Tensor:
        """The torch path: qkv ``[T, C]`` gathered to ``[B, Lq, C]`` -> o ``[T, HV, V]`` fp32."""
        lens, init, slots = meta.state_lens, meta.state_init, meta.state_slots
        q, k, v = self._heads(causal_conv_varlen(qkv[meta.q_index], lens, self.conv_state, slots, init, weight))
        B, Lq = meta.q_index.shape
        valid = torch.arange(Lq, device=qkv.device)[None, :] < lens[:, None]
        o = gated_delta_prefill(q, k, v, g[meta.q_index], beta[meta.q_index], valid, self.ssm_state, slots, init)
        return o.reshape(B * Lq, self.num_v_heads, self.head_v_dim)[meta.q_out_index]


class HybridDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int):
        super().__init__()
        self.is_linear = c.extra["layer_types"][index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = moe_block(c, renormalize=True) if num_experts(c) else MLP(c)
        self.input_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.is_linear else self.self_attn(x, positions, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.mlp(x, meta) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(x)), residual


class HybridDecoderModel(DecoderModel):
    """The dense trunk (same forward) over ``HybridDecoderLayer``s with zero-centred norms."""

    def __init__(self, c: ModelConfig):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([HybridDecoderLayer(c, i) for i in range(c.num_hidden_layers)])
        self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)  # partial: tables over rotary_dim only


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 / Qwen3.5-MoE text model (``Qwen3_5ForCausalLM`` or the text part of
    ``Qwen3_5ForConditionalGeneration``: ``model.language_model.*``; vision and MTP weights
    are skipped)."""

    model_class = HybridDecoderModel

    def __init__(self, config: ModelConfig):
        if "layer_types" not in config.extra:  # transformers' default: full attention every 4th layer
            interval = config.extra.get("full_attention_interval", 4)
            config.extra["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                                           for i in range(config.num_hidden_layers)]
        super().__init__(config)

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def routers(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    # ---- loading: HF names -> fused parameters ------------------------------------------------
    def _fused_rows(self, name: str) -> Optional[tuple[str, int, int]]:
        """(our parameter name, first row, end row) for an HF tensor that fills part of a fused one."""
        layer = self.model.layers[int(name.split(".")[2])]
        if layer.is_linear:
            gdn = layer.linear_attn
            sizes = {"in_proj_qkv": gdn.conv_dim, "in_proj_z": gdn.value_dim, "in_proj_b": gdn.num_v_heads,
                     "in_proj_a": gdn.num_v_heads}
            order, fused = list(sizes), "in_proj"
        else:
            attn = layer.self_attn
            sizes = {"q_proj": 2 * attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size}
            order, fused = list(sizes), "qkv_proj"
        mlp = layer.mlp if not isinstance(layer.mlp, SparseMoeBlock) else layer.mlp.shared_expert
        if mlp is not None:
            sizes.update(gate_proj=mlp.inter, up_proj=mlp.inter)
        for frag in sizes:
            if f".{frag}." in name:
                group = ["gate_proj", "up_proj"] if frag in ("gate_proj", "up_proj") else order
                start = sum(sizes[f] for f in group[:group.index(frag)])
                target = name.replace(f".{frag}.", ".gate_up_proj." if group[0] == "gate_proj" else f".{fused}.")
                return target, start, start + sizes[frag]
        return None

    @staticmethod
    def _local_name(name: str) -> Optional[str]:
        """Our name for an HF text-model tensor, or None for vision / MTP tensors."""
        if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            return None
        return name.replace("model.language_model.", "model.", 1)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into our (fused) parameters in place; returns the units
        filled (``expected_tensors``). Unknown names raise."""
        params = dict(self.named_parameters(remove_duplicate=False))
        n = 0
        for hf_name, tensor in named_tensors:
            name = self._local_name(hf_name)
            if name is None or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            units = load_expert_tensor(name, tensor, params, self._moe_inter)
            if units:
                n += units
                continue
            fused = self._fused_rows(name) if name.startswith("model.layers.") else None
            target = fused[0] if fused else name
            if target not in params:
                raise KeyError(f"no parameter for checkpoint tensor {hf_name!r}")
            dst = params[target].data if fused is None else params[target].data[fused[1]:fused[2]]
            if dst.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            n += 1
        return n

    def _moe_inter(self, prefix: str) -> int:
        return self.config.extra["moe_intermediate_size"]

    def expected_tensors(self) -> int:
        parts = {"qkv_proj": 3, "in_proj": 4, "gate_up_proj": 2}
        dense = sum(next((v for k, v in parts.items() if f".{k}." in n), 1)
                    for n, _ in self.named_parameters() if ".experts." not in n)
        return dense + expert_units(self)
