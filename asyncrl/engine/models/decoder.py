"""One dense decoder covering Qwen3 (q/k RMSNorm), Qwen2/2.5 (q/k/v bias) and Llama.

Tokens are packed: every forward takes ``input_ids [T]`` and ``positions [T]`` for all
sequences of the step concatenated, and an ``AttentionMetadata`` that says which cached
keys each token sees. Projections are fused (``qkv_proj``, ``gate_up_proj``): one GEMM
instead of three/two per layer, which matters at decode batch sizes.

HF parameter names are mapped onto the fused ones by ``load_weights`` (also used by
``LLM.update_weights``): ``q_proj/k_proj/v_proj -> qkv_proj`` and
``gate_proj/up_proj -> gate_up_proj``, each copied into its row slice in place, so the
parameter storage (and any CUDA graph captured over it) stays valid.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engine.attention import AttentionMetadata, paged_attention
from asyncrl.engine.models.config import ModelConfig


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32 like HF."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE. cos/sin are precomputed for all positions: ``[max_pos, D]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv = config.inv_freq()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q ``[T, H, D]``, k ``[T, Hkv, D]``, positions ``[T]``."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = self.head_dim ** -0.5
        # set by ModelRunner.allocate_kv_cache: [num_blocks + 1, block_size, Hkv, D]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, positions, rope, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb, meta)
        return self.norm(x)


# HF name fragment -> (our fused parameter fragment, shard name)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` (fp32)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into our (fused) parameters in place; returns #loaded.

        Unknown names raise: a silently skipped tensor would leave stale weights.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        c = self.config
        n = 0
        for name, tensor in named_tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue  # tied: embed_tokens.weight carries it
            target, rows = name, None
            for frag, (fused, shard) in _PACKED.items():
                if f".{frag}." in name:
                    target = name.replace(f".{frag}.", f".{fused}.")
                    rows = self._shard_rows(fused, shard)
                    break
            if target not in params:
                raise KeyError(f"no parameter for checkpoint tensor {name!r}")
            p = params[target]
            dst = p.data if rows is None else p.data[rows[0]: rows[1]]
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            n += 1
        return n

    def _shard_rows(self, fused: str, shard) -> tuple[int, int]:
        c = self.config
        if fused == "gate_up_proj":
            return shard * c.intermediate_size, (shard + 1) * c.intermediate_size
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[shard]
