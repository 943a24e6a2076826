"""Padding-free varlen layout for the trainer's forward on GPU: each prompt once, rows concatenated.

A GRPO micro-batch [B, P + L] (prompts left-padded to P, responses right-padded to L) is laid out
as ONE sequence of T real tokens with no padding:

    tokens = [prompt g (real tokens), response inputs of g's rows, one after another, prompt h, ...]

(a row's response inputs: its response tokens but the last, whose state predicts nothing). The
attention runs as varlen sequences over cumulative lengths (``cu_q``, ``cu_k``):

    prompt g:  queries = g's prompt tokens,    keys = the same tokens                 (causal)
    row r:     queries = r's response inputs,  keys = g's prompt tokens + r's inputs  (causal,
               aligned bottom-right: response input t sees the prompt and inputs 0..t)

so each prompt's states are computed once per group and every row reads its keys and values
(``key_index`` gathers them: [K] slots into the T tokens; the gather's backward sums a prompt
token's key/value gradients over its rows, as the padded batch's per-row prompts would). The
positions count real tokens as ``position_ids_from_mask`` does, so RoPE is unchanged: same
log-probs and gradients as the padded forward, to rounding (tests/training/test_varlen.py).

This is the CPU prefix-tree layout's idea (packing.py) without the dense [T, T] mask: varlen
attention costs what the real tokens cost, so it serves long rows (issue 8's 256 + 256 tokens,
or 512 + 2048). The kernel is FlashAttention's varlen forward/backward as PyTorch ships it
(``torch.nn.attention.varlen.varlen_attn``: no flash-attn wheel exists on PyPI for torch 2.11 /
CUDA 13 -- flash-attn 2.8.3 is a source distribution); elsewhere (the CPU, fp32, or a torch
without it) one SDPA call under the equivalent dense mask computes the same thing, for tests.
The model's attention reaches it through HF's ``AttentionInterface`` (registered as
``asyncrl_varlen``), so HF's modules, hooks and Liger's kernels run as they are.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.training.packing import _groups, response_lengths
from asyncrl.training.varlen_gather import SlotMap, gather_key_slots

ATTENTION_NAME = "asyncrl_varlen"
KWARG = "asyncrl_varlen"  # the layout travels to the attention function through HF's **kwargs


@dataclass
class VarlenRows:
    """The varlen layout of B rows. Shapes: T tokens, K key slots, S sequences, N response tokens.

    input_ids, position_ids [T] long; key_index [K] long (token index of each key slot, sequence
    by sequence); cu_q [S + 1], cu_k [S + 1] int32 (cumulative query / key lengths); max_q, max_k.
    state_index [N]: token index of the state predicting each real response token; token_index
    [N]: its flat index into [B * L]; targets [N]: its id. Invariant: sequence s's queries are
    tokens cu_q[s]..cu_q[s+1]-1 and its keys key_index[cu_k[s]:cu_k[s+1]], its queries last.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    key_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    state_index: torch.Tensor
    token_index: torch.Tensor
    targets: torch.Tensor
    slots: Optional[SlotMap] = None

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[0]


class _LayoutWriter:
    """Accumulates the layout's index lists, one prompt group at a time (C-level list extends)."""

    def __init__(self):
        self.tok: list[int] = []
        self.pos: list[int] = []
        self.keys: list[int] = []
        self.len_q: list[int] = []
        self.len_k: list[int] = []
        self.state_index: list[int] = []
        self.token_index: list[int] = []
        self.targets: list[int] = []
        self.first_slot: list[int] = []  # per token: its slot in its own sequence
        self.extra: list[tuple[int, int, list[int]]] = []  # per group with inputs: (prompt start, length, row bases)

    def sequence(self, queries: range, keys: list) -> None:
        self.keys.extend(keys)
        self.len_q.append(len(queries))
        self.len_k.append(len(keys))

    def group(self, prompt: list[int], responses: list[tuple[int, list[int]]], length: int) -> None:
        """Prompt ``prompt`` once, then each (row, response) of its group."""
        start, n = len(self.tok), len(prompt)
        self.tok.extend(prompt)
        self.pos.extend(range(n))
        prompt_slots = range(start, start + n)
        self.first_slot.extend(range(len(self.keys), len(self.keys) + n))
        self.sequence(prompt_slots, list(prompt_slots))
        row_bases = []  # first key slot of each row with inputs: its copy of the prompt
        for row, response in responses:
            inputs = response[:-1]
            first = len(self.tok)
            self.tok.extend(inputs)
            self.pos.extend(range(n, n + len(inputs)))
            if inputs:
                own = range(first, first + len(inputs))
                row_bases.append(len(self.keys))
                self.first_slot.extend(range(len(self.keys) + n, len(self.keys) + n + len(inputs)))
                self.sequence(own, [*prompt_slots, *own])
            if response:  # response token 0: the prompt's last state; token t: input t - 1's
                self.state_index.append(start + n - 1)
            self.state_index.extend(range(first, first + len(inputs)))
            self.token_index.extend(range(row * length, row * length + len(response)))
            self.targets.extend(response)
        if row_bases:  # prompt token i's other slots: base + i for each row base
            self.extra.append((start, n, row_bases))

    def pad_to(self, multiple: int) -> None:
        """Tail tokens (id 0) as one more sequence of their own, so T is a multiple of ``multiple``."""
        extra = -len(self.tok) % multiple
        if extra:
            first = len(self.tok)
            self.tok.extend([0] * extra)
            self.pos.extend(range(extra))
            self.first_slot.extend(range(len(self.keys), len(self.keys) + extra))
            self.sequence(range(extra), list(range(first, first + extra)))

    def result(self, device) -> VarlenRows:
        """The layout's tensors on ``device``: every index array goes over in ONE host->device copy
        (numpy-built: ``torch.tensor`` of ~10^5-element lists and a copy per array cost ~20 ms of
        host time per update at the GRPO shape, time the GPU sits idle)."""
        extra_tokens, extra_slots = self._extra_slots()
        parts = {"input_ids": self.tok, "position_ids": self.pos, "key_index": self.keys,
                 "cu_q": _cumulative(self.len_q), "cu_k": _cumulative(self.len_k), "state_index": self.state_index,
                 "token_index": self.token_index, "targets": self.targets, "first_slot": self.first_slot,
                 "extra_tokens": extra_tokens, "extra_slots": extra_slots.reshape(-1)}
        arrays = [np.asarray(v, dtype=np.int64) for v in parts.values()]
        flat = torch.from_numpy(np.concatenate(arrays)).to(device)
        t = dict(zip(parts, flat.split([len(a) for a in arrays])))
        slots = SlotMap(first_slot=t["first_slot"], extra_tokens=t["extra_tokens"],
                        extra_slots=t["extra_slots"].view(extra_slots.shape))
        return VarlenRows(input_ids=t["input_ids"], position_ids=t["position_ids"], key_index=t["key_index"],
                          cu_q=t["cu_q"].int(), cu_k=t["cu_k"].int(), max_q=max(self.len_q), max_k=max(self.len_k),
                          state_index=t["state_index"], token_index=t["token_index"], targets=t["targets"],
                          slots=slots)

    def _extra_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [P], their other slots [P, W] padded with -1) from the groups' row bases."""
        width = max((len(bases) for _, _, bases in self.extra), default=0)
        tokens, slots = [np.zeros(0, np.int64)], [np.zeros((0, width), np.int64)]
        for start, n, bases in self.extra:
            offsets = np.arange(n, dtype=np.int64)
            block = np.full((n, width), -1, dtype=np.int64)
            block[:, :len(bases)] = offsets[:, None] + np.asarray(bases, dtype=np.int64)[None, :]
            tokens.append(start + offsets)
            slots.append(block)
        return np.concatenate(tokens), np.concatenate(slots)


def _cumulative(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def varlen_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                pad_multiple: int = 1) -> Optional[VarlenRows]:
    """The varlen layout of a padded batch, or None when a row's response is not a contiguous
    prefix of its response region or a prompt is empty (then only the padded layout is faithful).
    ``pad_multiple``: pad T up to a multiple (bucketed shapes for torch.compile)."""
    lengths = response_lengths(attention_mask, prompt_length)
    if lengths is None:
        return None
    P = prompt_length
    ids, prompt_mask, lens = input_ids.tolist(), attention_mask[:, :P].tolist(), lengths.tolist()
    groups = _groups([(tuple(ids[r][:P]), tuple(prompt_mask[r])) for r in range(len(ids))])
    writer, length = _LayoutWriter(), input_ids.shape[1] - P
    for rows in groups:
        prompt = [t for t, m in zip(ids[rows[0]][:P], prompt_mask[rows[0]]) if m]
        if not prompt:
            return None
        writer.group(prompt, [(r, ids[r][P:P + lens[r]]) for r in rows], length)
    writer.pad_to(max(1, pad_multiple))
    return writer.result(input_ids.device)


# -- the attention --------------------------------------------------------------------------

def _dense_varlen(q, k, v, rows: VarlenRows, scale: float) -> torch.Tensor:
    """Reference varlen attention: one SDPA call under the dense [T, K] mask that the
    sequences define (same sequence, key no later than the query, aligned bottom-right)."""
    len_q, len_k = rows.cu_q.diff().long(), rows.cu_k.diff().long()
    seq_q = torch.repeat_interleave(torch.arange(len(len_q), device=q.device), len_q)
    seq_k = torch.repeat_interleave(torch.arange(len(len_k), device=q.device), len_k)
    from_end_q = rows.cu_q[1:].long()[seq_q] - 1 - torch.arange(q.shape[0], device=q.device)
    from_end_k = rows.cu_k[1:].long()[seq_k] - 1 - torch.arange(k.shape[0], device=q.device)
    mask = (seq_q[:, None] == seq_k[None, :]) & (from_end_k[None, :] >= from_end_q[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


@functools.lru_cache(maxsize=1)
def _torch_varlen_params() -> Optional[frozenset]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q, k, v, rows: VarlenRows, scale: float) -> torch.Tensor:
    """PyTorch's FlashAttention varlen kernel (CUDA, bf16/fp16), across its 2.9-2.13 signatures."""
    from torch.nn.attention.varlen import varlen_attn
    params = _torch_varlen_params()
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's default scale is 1/sqrt(D)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif _GQA_BY_REPEAT[0]:  # a wrapper that refused fewer KV heads (probe_flash found out)
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, **kwargs)


_GQA_BY_REPEAT = [False]  # set by probe_flash when the kernel rejects fewer KV heads than query heads


def use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _torch_varlen_params() is not None


@torch.compiler.disable  # a graph break in compiled blocks: the kernel's int lengths stay out of guards
def attend(q, k, v, rows: VarlenRows, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [K, Hkv, D] (already gathered by ``key_index``) -> [T, H, D]."""
    return _flash_varlen(q, k, v, rows, scale) if use_flash(q) else _dense_varlen(q, k, v, rows, scale)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface entry: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    rows: VarlenRows = kwargs[KWARG]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D] (HF's layout already: a no-op copy)
    k = gather_key_slots(key[0].transpose(0, 1), rows.key_index, rows.slots)
    v = gather_key_slots(value[0].transpose(0, 1), rows.key_index, rows.slots)
    return attend(q, k, v, rows, scale).unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """The varlen kernel needs no [T, T] mask: HF's mask builder gets None for this implementation."""
    return None


@functools.lru_cache(maxsize=1)
def register() -> str:
    """Registers ``varlen_attention`` with HF's attention interface and a mask function that
    builds nothing (once); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME


@contextlib.contextmanager
def config_implementation(config, name: str):
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


def attention_implementation(model, name: str):
    """``model.config._attn_implementation`` is ``name`` within (HF's attention modules read it at
    every call); restored after, so other calls keep the model's own implementation."""
    return config_implementation(model.config, name)



def varlen_supported(model) -> Optional[str]:
    """Why the varlen layout cannot run ``model`` (None: it can): every layer must be full
    attention that HF dispatches through its attention interface."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full-attention layers pack by cumulative lengths)"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", "flash_attention_2", "flex_attention",
                                                               ATTENTION_NAME):
        return f"attention implementation {config._attn_implementation!r}"
    return None


def varlen_hidden(model, base, rows: VarlenRows) -> torch.Tensor:
    """[T, H] final hidden states of the layout's tokens, one forward of ``base`` (the decoder)."""
    with attention_implementation(model, register()):
        out = base(input_ids=rows.input_ids[None], position_ids=rows.position_ids[None], use_cache=False,
                   **{KWARG: rows})
    return out.last_hidden_state[0]


def probe_flash(device, dtype) -> Optional[str]:
    """Runs PyTorch's varlen kernel once (GQA, bottom-right causal, forward and backward) against
    the dense reference on ``device``; returns why it cannot be used (None: it matches). Tries the
    kernel's own GQA first, then key/value heads repeated."""
    if _torch_varlen_params() is None:
        return "torch.nn.attention.varlen is missing in this torch"
    reasons = []
    for repeat in (False, True):
        _GQA_BY_REPEAT[0] = repeat
        reason = _probe_once(device, dtype)
        if reason is None:
            return None
        reasons.append(reason)
    _GQA_BY_REPEAT[0] = False
    return "; ".join(reasons)


def _probe_once(device, dtype) -> Optional[str]:
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        writer = _LayoutWriter()
        writer.group([1, 2, 3, 4, 5], [(0, [6, 7, 8]), (1, [9, 10])], 3)
        rows = writer.result(device)
        T = rows.tokens
        q = torch.randn(T, 4, 64, generator=g).to(device, dtype).requires_grad_()
        kv = torch.randn(2, T, 2, 64, generator=g).to(device, dtype).requires_grad_()
        outs = []
        for fn in (_flash_varlen, _dense_varlen):
            out = fn(q, kv[0][rows.key_index], kv[1][rows.key_index], rows, 0.125)
            grads = torch.autograd.grad(out.float().square().sum(), (q, kv))
            outs.append((out.float(), *(x.float() for x in grads)))
        for a, b in zip(*outs):
            if not torch.allclose(a, b, atol=3e-2, rtol=3e-2):
                return f"varlen kernel differs from the dense reference by {float((a - b).abs().max()):.3g}"
    except Exception as exc:  # noqa: BLE001 -- any failure means: use the padded layout
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None
