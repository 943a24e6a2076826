"""ModelConfig: the architecture numbers read straight from an HF ``config.json``.

We parse the JSON ourselves (no ``AutoConfig``) so the engine reads a checkpoint the
same way whichever transformers version is installed; both the v4 keys
(``rope_theta``/``rope_scaling``) and the v5 key (``rope_parameters``) are accepted.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

# architecture name -> (attention has q/k RMSNorm, q/k/v projections have a bias)
ARCHITECTURES = {
    "Qwen3ForCausalLM": (True, False),
    "Qwen2ForCausalLM": (False, True),
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    # families with their own model class (models/registry.py): Qwen3-MoE (moe.py) and the
    # Qwen3.5 hybrid Gated DeltaNet decoder, dense or MoE (qwen3_5.py)
    "Qwen3MoeForCausalLM": (True, False),
    "Qwen3_5ForCausalLM": (True, False),
    "Qwen3_5ForConditionalGeneration": (True, False),
    "Qwen3_5MoeForCausalLM": (True, False),
    "Qwen3_5MoeForConditionalGeneration": (True, False),
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    # the rest of the (text) config.json: family-specific numbers (layer_types, linear_*,
    # num_experts, ...) read by the family's own model class (models/qwen3_5.py, moe.py)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):  # generation_config's eos list wins (Qwen instruct models)
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw)

    @classmethod
    def from_module(cls, hf) -> "ModelConfig":
        """From an in-memory HF ``*ForCausalLM``: its config, with the EOS list of its
        ``generation_config`` winning as ``from_dir`` lets generation_config.json win (a Qwen
        instruct model stops at <|im_end|> or <|endoftext|>, its config.json names one)."""
        raw = hf.config.to_dict()
        eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw, architecture=type(hf).__name__)

    @classmethod
    def from_dict(cls, raw: dict, architecture: Optional[str] = None) -> "ModelConfig":
        """From a config.json dict (or an HF ``PretrainedConfig.to_dict()``)."""
        arch = architecture or (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if isinstance(raw.get("text_config"), dict):  # a multimodal wrapper (Qwen3.5): the text model's numbers
            outer = {k: raw[k] for k in ("eos_token_id", "tie_word_embeddings", "torch_dtype", "dtype",
                                         "mamba_ssm_dtype") if k in raw}
            raw = {**raw["text_config"], **{k: v for k, v in outer.items() if v is not None}}
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
        qk_norm, qkv_bias = ARCHITECTURES[arch]
        qkv_bias = bool(raw.get("attention_bias", qkv_bias)) or qkv_bias
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size", 0),  # all-MoE models (Qwen3.5-MoE) have none
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            rope_theta=float(theta),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            extra=raw,
        )

    @property
    def rotary_dim(self) -> int:
        rope = self.extra.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", self.extra.get("partial_rotary_factor", 1.0))
        return int(self.head_dim * factor)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies ``[rotary_dim // 2]`` (fp32), with Llama-3 scaling if set;
        ``rotary_dim = head_dim * partial_rotary_factor`` (Qwen3.5 rotates a quarter of each head)."""
        d = self.rotary_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        s = self.rope_scaling or {}
        kind = s.get("rope_type", s.get("type", "default"))
        if kind in (None, "default"):
            return inv
        if kind == "linear":
            return inv / s["factor"]
        if kind == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
            return torch.where(is_mid, mid, scaled)
        raise ValueError(f"unsupported rope scaling {kind!r}")
