"""Mixture-of-experts layers for the engine, and the Qwen3-MoE decoder built on them.

Routing is computed exactly as transformers computes it (``Qwen3MoeTopKRouter``,
``Qwen3_5MoeTopKRouter``): router logits in the model dtype, softmax in fp32, top-k, the
top-k weights renormalised to sum to 1 iff ``norm_topk_prob`` (always for Qwen3.5-MoE), then
cast back to the logits' dtype. The experts are applied by a grouped GEMM over the tokens
routed to each expert (``moe_experts``): a Triton kernel on GPU (``triton_moe.py``), a loop
over the experts hit on CPU.

Weights are kept in transformers 5's packed layout (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``): one tensor per layer, expert-major, which is also the
layout an expert-parallel shard takes (a contiguous range of experts). ``load_weights``
accepts both the packed names (an in-memory HF model) and per-expert checkpoint names
(``experts.{e}.gate_proj.weight`` ..., as Qwen3-30B-A3B ships them).

Routing replay (R3): when ``routing_buffer`` is set (``[slots, L_moe, K]`` int16, indexed by
KV slot like the K/V cache, ``ModelRunner``), every forward writes the experts it chose for
each token at that token's slot, so a completion's routing can be gathered through its block
table (forks share the prompt's) and replayed by the trainer (``training/routing_replay.py``).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.engine.attention import AttentionMetadata
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.models.decoder import MLP, Attention, CausalLM, DecoderModel, RMSNorm, RotaryEmbedding


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          record: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (weights ``[T, K]`` in the logits' dtype, expert ids ``[T, K]``
    int64): one fused Triton launch on CUDA (``triton_moe_align.fused_route``), torch elsewhere.
    ``record = (buffer [S, L_moe, K] int16, slots [T], column)``: the ids are also written at
    ``buffer[slots, column]`` (routing replay)."""
    if logits.is_cuda:
        from asyncrl.engine.triton_moe_align import fused_route

        return fused_route(logits, top_k, renormalize, record)
    weights, ids = route_torch(logits, top_k, renormalize)
    if record is not None:
        buffer, slots, column = record
        buffer[slots, column] = ids.to(buffer.dtype)
    return weights, ids


def route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path, transformers' router verbatim: fp32 softmax, top-k, renormalised iff
    ``renormalize``, cast back to the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Reference path: for each expert hit, ``silu(x W_gate^T) * (x W_up^T) W_down^T`` on its
    tokens, weighted and summed per token. x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``,
    weights/ids ``[T, K]`` -> ``[T, H]``."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        tok = tokens[start:start + n]
        start += n
        gate_up = F.linear(x[tok], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * weights.reshape(-1)[sel, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' output ``[T, H]``: Triton grouped GEMM on CUDA, torch elsewhere."""
    if x.is_cuda:
        from asyncrl.engine.triton_moe import fused_moe

        return fused_moe(x, w13, w2, weights, ids)
    return moe_experts_torch(x, w13, w2, weights, ids)


class Experts(nn.Module):
    """Packed expert weights (transformers 5 names): gate_up_proj ``[E, 2I, H]``, down_proj ``[E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class Router(nn.Module):
    """``weight [E, H]``: logits = x W^T (no bias), as ``Qwen3MoeTopKRouter``."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    """Routed experts (+ an optional sigmoid-gated shared expert, Qwen3.5-MoE).

    ``forward(x [T, H], meta) -> [T, H]``. When ``routing_buffer`` is set, the chosen expert
    ids of the step's tokens are written at their KV slots, in column ``moe_index``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, renormalize: bool,
                 shared_inter: int = 0):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Router(num_experts, hidden)
        self.experts = Experts(num_experts, hidden, inter)
        self.shared_expert = None
        if shared_inter:
            self.shared_expert = MLP(_MlpShape(hidden, shared_inter))
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.routing_buffer: Optional[torch.Tensor] = None  # [slots, L_moe, K] int16 (ModelRunner)
        self.moe_index = 0

    def forward(self, x: torch.Tensor, meta: Optional[AttentionMetadata] = None) -> torch.Tensor:
        record = None
        if self.routing_buffer is not None and meta is not None:
            record = (self.routing_buffer, meta.slot_mapping, self.moe_index)
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize, record)
        out = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class _MlpShape:
    """The two numbers ``decoder.MLP`` reads from a config."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size


def num_experts(c: ModelConfig) -> int:
    """``num_experts`` (config class attribute) or ``num_local_experts`` (as transformers 5 saves it)."""
    return int(c.extra.get("num_experts") or c.extra.get("num_local_experts") or 0)


def is_moe_layer(c: ModelConfig, index: int) -> bool:
    """Qwen3-MoE: sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    x = c.extra
    return (num_experts(c) > 0 and index not in (x.get("mlp_only_layers") or [])
            and (index + 1) % x.get("decoder_sparse_step", 1) == 0)


def moe_block(c: ModelConfig, renormalize: Optional[bool] = None) -> SparseMoeBlock:
    x = c.extra
    norm = bool(x.get("norm_topk_prob", False)) if renormalize is None else renormalize
    return SparseMoeBlock(c.hidden_size, num_experts(c), x["num_experts_per_tok"], x["moe_intermediate_size"],
                          norm, x.get("shared_expert_intermediate_size", 0))


# ---- loading -------------------------------------------------------------------------------
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_target(name: str, params: dict, inter_of) -> Optional[tuple[torch.Tensor, str]]:
    """A per-expert checkpoint tensor's destination: (view into the packed parameter, its
    name) or None if ``name`` is not one. ``inter_of(prefix)``: that layer's I."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down_proj":
        return params[f"{prefix}.down_proj"].data[e], f"{prefix}.down_proj"
    inter = inter_of(prefix)
    rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
    return params[f"{prefix}.gate_up_proj"].data[e, rows], f"{prefix}.gate_up_proj"


def expert_units(model: nn.Module) -> int:
    """How many load units the expert parameters need: packed tensors count one unit per
    (expert, gate/up/down) so packed and per-expert checkpoints fill the same total."""
    return sum(3 * m.experts.gate_up_proj.shape[0] for m in model.modules() if isinstance(m, SparseMoeBlock))


def load_expert_tensor(name: str, tensor: torch.Tensor, params: dict, inter_of) -> int:
    """Copy one expert tensor (packed or per expert) in place; returns the units it filled
    (0: not an expert tensor)."""
    hit = expert_target(name, params, inter_of)
    if hit is not None:
        dst = hit[0]
        units = 1
    elif name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
        if name not in params:
            raise KeyError(f"no parameter for checkpoint tensor {name!r}")
        dst = params[name].data
        units = dst.shape[0] * (2 if name.endswith("gate_up_proj") else 1)
    else:
        return 0
    if dst.shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
    dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
    return units


# ---- Qwen3-MoE --------------------------------------------------------------------------------
class MoeDecoderLayer(nn.Module):
    """Qwen3 attention (q/k norm, full RoPE) + a sparse MoE block or a dense MLP."""

    def __init__(self, c: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = moe_block(c) if is_moe_layer(c, index) else MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        out = self.mlp(x, meta) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(x)
        return out, residual


class MoeDecoderModel(DecoderModel):
    """The dense trunk (same forward) over ``MoeDecoderLayer``s."""

    def __init__(self, c: ModelConfig):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([MoeDecoderLayer(c, i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the dense decoder's attention with MoE MLPs."""

    model_class = MoeDecoderModel

    def __init__(self, config: ModelConfig):
        if config.extra.get("use_sliding_window"):
            raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported by the engine "
                             "(rollout.backend=hf runs it)")
        super().__init__(config)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.named_parameters(remove_duplicate=False))
        inter = self.config.extra.get("moe_intermediate_size", 0)
        dense: list[tuple[str, torch.Tensor]] = []
        n = 0
        for name, tensor in named_tensors:
            units = load_expert_tensor(name, tensor, params, lambda prefix: inter)
            if units:
                n += units
            else:
                dense.append((name, tensor))
        return n + super().load_weights(dense)

    def expected_tensors(self) -> int:
        """Load units a complete checkpoint fills (``loader.load_model`` checks it)."""
        dense = sum(3 if "qkv_proj" in n else 2 if "gate_up_proj" in n and ".experts." not in n else 1
                    for n, _ in self.named_parameters() if ".experts." not in n)
        return dense + expert_units(self)

    def routers(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
