"""EagleHead: an EAGLE-style draft head (Li et al., arXiv 2401.15077; training as EAGLE-3, 2503.01840).

One decoder layer of the target's family that reads the target's own features and drafts the
next tokens autoregressively, reusing the target's embedding and LM head (not stored):

    entry p:   x = fc([embed_norm(embed(token_p)) ; feature_{p-1}])   fc: [H, 2H]; feature_{-1} = 0
               g_p = norm(layer(x))                          ~ the target's feature at p
               draft token p+1 ~ target.lm_head(g_p)

``feature_p`` is the target's last hidden state at position p after its final norm (the input
of its LM head: EAGLE-1's choice, what ``VerifyStep`` returns). While drafting, the head's
own ``g`` stands in for the feature it has not got yet (step j feeds ``g`` of step j - 1).

``embed_norm`` (an RMSNorm, as EAGLE-3 normalises the embedding before its fc): a token embedding
(std ~0.02 at init, small in trained models too) enters fc ~50x weaker than the RMS-normalised
feature beside it, so the head long ignored the token, and pass 1 (the first draft, which gates
every later one) learned last: on the tiny CPU target, 100 training steps gave a held-out
acceptance of 0.27 without it and 0.75 with it (bench/RESULTS.md). Heads written before it
(no ``embed_norm`` in their ``eagle_head`` block) load and run as they were trained.

Checkpoint (``save`` / ``load_head``): a directory with an HF-style ``config.json`` -- the target's
config with ``num_hidden_layers: 1``, the dense layer family in ``architectures`` and an
``eagle_head`` block (target hidden size, feature kind, provenance) -- and ``model.safetensors``
with HF names: ``fc.weight``, ``layers.0.self_attn.q_proj.weight`` ..., ``norm.weight``.

Two forwards share the parameters: ``forward`` (the engine's packed tokens over the head's own
paged K/V, ``spec/eagle.py``) and ``unrolled`` (dense ``[B, T]`` batches for training with
EAGLE-3's training-time test: pass j feeds pass j - 1's outputs as features, each query
attending to the true-feature keys before its chain and to its own chain, exactly what the
engine's step j sees).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from asyncrl.engine.attention import AttentionMetadata, masked_sdpa
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import CausalLM, DecoderLayer, RMSNorm, RotaryEmbedding, _qkv_prepare

CONFIG_KEY = "eagle_head"
FEATURE = "final_norm_hidden"  # the only feature kind so far (EAGLE-3's multi-layer fusion: not yet)


def _dense_family(target: ModelConfig) -> str:
    """The head layer's HF architecture: the target's dense family (an MoE target gets a dense layer)."""
    if target.qk_norm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if target.qkv_bias else "LlamaForCausalLM"


def head_config_dict(target: ModelConfig, **provenance) -> dict:
    """config.json of a fresh head for ``target``: its numbers, one layer, the ``eagle_head`` block."""
    raw = {k: v for k, v in target.extra.items() if k not in ("text_config", "layer_types", "auto_map")}
    raw.update(architectures=[_dense_family(target)], num_hidden_layers=1, vocab_size=target.vocab_size,
               hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
               num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
               head_dim=target.head_dim, tie_word_embeddings=False, torch_dtype="float32")
    raw.pop("dtype", None)
    raw[CONFIG_KEY] = {"target_hidden_size": target.hidden_size, "feature": FEATURE, "embed_norm": True,
                       **provenance}
    return raw


def is_head_dir(path) -> bool:
    cfg = os.path.join(str(path), "config.json")
    if not os.path.isfile(cfg):
        return False
    with open(cfg) as f:
        return CONFIG_KEY in json.load(f)


class EagleHead(nn.Module):
    """Parameters: ``embed_norm`` (heads from before it: none), ``fc [H, 2H]``, one ``DecoderLayer``
    (fused qkv / gate_up as the engine's), ``norm``. Invariant: ``config.hidden_size`` equals the
    target's hidden size and ``config.vocab_size`` its vocabulary (``check_target``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_norm = RMSNorm(H, config.rms_norm_eps) if self.info.get("embed_norm") else None
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def info(self) -> dict:
        return dict(self.config.extra.get(CONFIG_KEY, {}))

    def check_target(self, target: ModelConfig) -> None:
        if (self.config.hidden_size, self.config.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(f"the EAGLE head (hidden {self.config.hidden_size}, vocabulary {self.config.vocab_size}) "
                             f"does not fit the target (hidden {target.hidden_size}, vocabulary "
                             f"{target.vocab_size}): train one for this policy with `asyncrl train-draft`")

    # ---- engine forward ----------------------------------------------------------
    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """embeds, features ``[T, H]`` (packed entries), positions ``[T]`` -> g ``[T, H]``; writes
        the entries' K/V into the head's cache at ``meta.slot_mapping``."""
        x, residual = self.layers[0](self.fc_input(embeds, features), None, positions, self.rotary_emb, meta)
        return self.norm(x, residual)[0]

    def fc_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``fc([embed_norm(embeds) ; features])`` for embeds, features ``[..., H]`` -> ``[..., H]``."""
        if self.embed_norm is not None:
            embeds = self.embed_norm(embeds)
        return self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    # ---- training forward (dense, training-time test) -----------------------------
    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """embeds ``[B, T, H]`` of tokens 0..T-1, features ``[B, T, H]`` (true target features,
        ``features[:, p]`` = feature_p) -> per pass j = 1..passes, g ``[B, T, H]``: pass 1
        reads the true feature_{p-1}, pass j > 1 reads pass j - 1's g at p - 1. Query p of pass
        j attends pass-1 keys at positions <= p - j + 1 and pass-i keys (1 < i <= j) at p - j + i:
        the engine's j-th draft step at position p."""
        B, T, H = embeds.shape
        prev = features
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for j in range(1, passes + 1):
            shifted = torch.cat([prev.new_zeros(B, 1, H), prev[:, :-1]], dim=1)
            g = self._dense_layer(self.fc_input(embeds, shifted), keys, j)
            outs.append(g)
            prev = g
        return outs

    def _dense_layer(self, x: torch.Tensor, keys: list, j: int) -> torch.Tensor:
        layer = self.layers[0]
        h = self._dense_attention(layer.input_layernorm(x), keys, j)
        h, residual = layer.post_attention_layernorm(h, x)
        return self.norm(layer.mlp(h), residual)[0]

    def _dense_attention(self, x: torch.Tensor, keys: list, j: int) -> torch.Tensor:
        """Self-attention of pass ``j`` over the keys of passes 1..j (``keys`` grows by this pass's)."""
        attn, (B, T, H) = self.layers[0].self_attn, x.shape
        pos = torch.arange(T, device=x.device).repeat(B)
        qn, kn = attn.qk_norm_weights()
        q, k, v = _qkv_prepare(attn.qkv_proj(x.reshape(B * T, H)), pos, self.rotary_emb.cos, self.rotary_emb.sin,
                               qn, kn, attn.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        keys.append((k.view(B, T, attn.num_kv_heads, -1), v.view(B, T, attn.num_kv_heads, -1)))
        K = torch.cat([kk for kk, _ in keys], dim=1).transpose(1, 2)  # [B, Hkv, j*T, D]
        V = torch.cat([vv for _, vv in keys], dim=1).transpose(1, 2)
        Q = q.view(B, T, attn.num_heads, -1).transpose(1, 2)
        mask = ttt_mask(T, j, x.device)
        # masked_sdpa: every training batch brings a new T (cuDNN's backend would plan each one)
        o = masked_sdpa(Q, K, V, attn_mask=mask, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads)
        return attn.o_proj(o.transpose(1, 2).reshape(B, T, attn.q_size))

    # ---- checkpoint ---------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named tensors (the fused qkv / gate_up split back), contiguous fp32 copies."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        out = {}
        for name, t in self.state_dict().items():
            if "rotary_emb" in name:
                continue
            t = t.detach().float().cpu()
            if "qkv_proj" in name:
                q, k, v = t.split([attn.q_size, attn.kv_size, attn.kv_size])
                for frag, piece in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[name.replace("qkv_proj", frag)] = piece.contiguous()
            elif "gate_up_proj" in name:
                gate, up = t.split(mlp.inter)
                out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
                out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
            else:
                out[name] = t.contiguous()
        return out

    def save(self, path, **provenance) -> None:
        """Write ``config.json`` + ``model.safetensors`` into ``path`` (created)."""
        os.makedirs(path, exist_ok=True)
        raw = dict(self.config.extra)
        raw[CONFIG_KEY] = {**raw.get(CONFIG_KEY, {}), **provenance}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        save_file(self.hf_state_dict(), os.path.join(path, "model.safetensors"))


def ttt_mask(T: int, j: int, device) -> torch.Tensor:
    """Boolean ``[T, j*T]``: query p of pass j sees pass-1 keys q <= p - j + 1 and, for passes
    i = 2..j, the single key p - j + i (its own draft chain)."""
    p = torch.arange(T, device=device)[:, None]
    q = torch.arange(T, device=device)[None, :]
    blocks = [q <= p - j + 1] + [q == p - j + i for i in range(2, j + 1)]
    return torch.cat(blocks, dim=1)


INITS = ("random", "identity")


def new_head(target: ModelConfig, seed: int = 0, init: str = "random", **provenance) -> EagleHead:
    """A freshly initialised head for ``target`` (fp32), unit norms and, by ``init``:

    ``random``: every matrix ~ N(0, 0.02) (EAGLE's initialisation).
    ``identity``: fc passes the feature through (its feature half = I, its embedding half = 0) and
    the layer's residual writes (o_proj, down_proj) start at 0, the rest ~ N(0, 0.02): the untrained
    head returns g = norm(feature_{p-1}), i.e. drafts the target's own last choice again, for any
    target (tied or not). Training learns the change from there; what it never sees (tokens absent
    from its samples) keeps that rule instead of the random map a random init leaves there
    (bench/RESULTS.md, issue 23: a head trained from random init on a vocabulary its samples did
    not cover drafted nothing on fresh prompts)."""
    if init not in INITS:
        raise ValueError(f"EAGLE head init {init!r}: expected one of {INITS}")
    head = EagleHead(ModelConfig.from_dict(head_config_dict(target, initialised=init, **provenance)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        if init == "identity":
            H = head.config.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, H:].copy_(torch.eye(H))
            head.layers[0].self_attn.o_proj.weight.zero_()
            head.layers[0].mlp.down_proj.weight.zero_()
    return head


def load_head(path, dtype: Optional[torch.dtype] = None, device="cpu") -> EagleHead:
    """An ``EagleHead`` from a checkpoint directory written by ``save`` (HF names)."""
    from asyncrl.engine.models.loader import iter_safetensors

    if not is_head_dir(path):
        raise ValueError(f"{path} is not an EAGLE head checkpoint (its config.json has no {CONFIG_KEY!r} "
                         "block): write one with `asyncrl train-draft`")
    config = ModelConfig.from_dir(str(path))
    with torch.device(device):
        head = EagleHead(config)
    head.to(dtype=dtype or torch.float32)
    head.rotary_emb.float()  # RoPE tables stay fp32 (as the decoder's)
    loaded = CausalLM.load_weights(head, iter_safetensors(str(path)))  # same HF-name mapping as the target
    expected = sum(3 if "qkv_proj" in n else 2 if "gate_up" in n else 1 for n, _ in head.named_parameters())
    if loaded != expected:
        raise ValueError(f"EAGLE head checkpoint {path} filled {loaded} tensors, the head needs {expected}")
    return head.eval()
