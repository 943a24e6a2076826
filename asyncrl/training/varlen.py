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

from asyncrl.engine.attention import masked_sdpa
from asyncrl.training.packing import response_lengths
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


def _ragged(starts, lengths) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n) pair, in order: [sum(lengths)] int64."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)


def _exclusive(lengths) -> np.ndarray:
    """[n] starts of consecutive spans of ``lengths``."""
    return np.cumsum(lengths) - lengths


def _layout_arrays(prompts: np.ndarray, prompt_len: np.ndarray, group_of: np.ndarray, rows: np.ndarray,
                   responses: np.ndarray, response_len: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """The layout's index arrays, built with whole-array numpy (no per-row Python: ~1 ms instead of
    ~25 ms of list building at 128 rows x (256 + 256) tokens, host time the GPU sat idle in).

    prompts [sum n] the groups' real prompt tokens one group after another, prompt_len [G] (n, all
    > 0); group_of [R] each row's group (non-decreasing: rows listed group by group, in layout
    order), rows [R] each row's batch index, responses [R, >= max len] and response_len [R] its
    response tokens; ``length`` the batch's response width (token_index = row * length + t).

    Token order: group g's prompt, then each of its rows' inputs (response tokens but the last).
    Sequence order: g's prompt, then each of its rows with inputs (see the module doc)."""
    G, n = len(prompt_len), prompt_len
    m = np.maximum(response_len - 1, 0)                  # [R] inputs per row
    m_per_group = np.bincount(group_of, weights=m, minlength=G).astype(np.int64)
    group_start = _exclusive(n + m_per_group)            # [G] first token of each group
    first_row = _exclusive(np.bincount(group_of, minlength=G))
    own = group_start[group_of] + n[group_of] + _exclusive(m) - _exclusive(m)[first_row][group_of]  # [R]
    T = int((n + m_per_group).sum())
    prompt_tokens, input_tokens = _ragged(group_start, n), _ragged(own, m)
    input_offset = _ragged(np.zeros_like(m), m)
    tok, pos = np.empty(T, np.int64), np.empty(T, np.int64)
    tok[prompt_tokens], pos[prompt_tokens] = prompts, _ragged(np.zeros_like(n), n)
    tok[input_tokens] = responses[np.repeat(np.arange(len(rows)), m), input_offset]
    pos[input_tokens] = np.repeat(n[group_of], m) + input_offset
    # sequences: g's prompt (keys: its tokens), then each row with inputs (keys: g's prompt, its inputs)
    has = np.nonzero(m > 0)[0]
    seq_group = np.concatenate([np.arange(G), group_of[has]])
    order = np.lexsort((np.concatenate([np.full(G, -1), has]), seq_group))
    own_len = np.concatenate([np.zeros(G, np.int64), m[has]])[order]
    own_start = np.concatenate([np.zeros(G, np.int64), own[has]])[order]
    g_of_seq = seq_group[order]
    len_q = np.where(own_len > 0, own_len, n[g_of_seq])
    len_k = n[g_of_seq] + own_len
    key_start = _exclusive(len_k)                        # [S] first key slot of each sequence
    pieces = np.stack([group_start[g_of_seq], own_start], 1).reshape(-1)
    key_index = _ragged(pieces, np.stack([n[g_of_seq], own_len], 1).reshape(-1))
    first_slot = np.empty(T, np.int64)
    is_prompt = own_len == 0
    first_slot[prompt_tokens] = _ragged(key_start[is_prompt], n)
    row_seq_start = key_start[~is_prompt]                # rows with inputs, in layout order (= has order)
    first_slot[_ragged(own[has], m[has])] = _ragged(row_seq_start + n[group_of[has]], m[has])
    # a row's response token 0 is predicted by its prompt's last state, token t by input t - 1's
    state_pieces = np.stack([group_start[group_of] + n[group_of] - 1, own], 1).reshape(-1)
    state_index = _ragged(state_pieces, np.stack([(response_len > 0).astype(np.int64), m], 1).reshape(-1))
    token_index = _ragged(rows * length, response_len)
    targets = responses[np.repeat(np.arange(len(rows)), response_len), _ragged(np.zeros_like(response_len),
                                                                                 response_len)]
    extra_tokens, extra_slots = _extra_slots(group_start, n, group_of[has], row_seq_start, G)
    return {"input_ids": tok, "position_ids": pos, "key_index": key_index, "len_q": len_q, "len_k": len_k,
            "state_index": state_index, "token_index": token_index, "targets": targets, "first_slot": first_slot,
            "extra_tokens": extra_tokens, "extra_slots": extra_slots}


def _extra_slots(group_start, n, groups_with_inputs, row_seq_start, G) -> tuple[np.ndarray, np.ndarray]:
    """A prompt token's slots besides its own sequence's: one per row of its group with inputs
    (that row's copy of the prompt, at its sequence's first key slot + i). Returns (tokens [P],
    slots [P, W]) with W the most such rows of a group, padded with -1."""
    count = np.bincount(groups_with_inputs, minlength=G)
    chosen = np.nonzero(count > 0)[0]
    width = int(count.max()) if len(count) else 0
    tokens = _ragged(group_start[chosen], n[chosen])
    slots = np.full((len(tokens), width), -1, np.int64)
    if len(groups_with_inputs):
        block_start = np.zeros(G, np.int64)
        block_start[chosen] = _exclusive(n[chosen])      # each chosen group's first row in [P, W]
        rank = np.arange(len(groups_with_inputs)) - _exclusive(count)[groups_with_inputs]
        g_rep = np.repeat(groups_with_inputs, n[groups_with_inputs])
        i = _ragged(np.zeros_like(groups_with_inputs), n[groups_with_inputs])
        slots[block_start[g_rep] + i, np.repeat(rank, n[groups_with_inputs])] = \
            np.repeat(row_seq_start, n[groups_with_inputs]) + i
    return tokens, slots


def _pad_layout(arrays: dict[str, np.ndarray], multiple: int) -> None:
    """Tail tokens (id 0) as one more sequence of their own, so T is a multiple of ``multiple``."""
    T, K = len(arrays["input_ids"]), len(arrays["key_index"])
    extra = -T % multiple
    if not extra:
        return
    span = np.arange(extra, dtype=np.int64)
    for key, tail in (("input_ids", np.zeros(extra, np.int64)), ("position_ids", span), ("key_index", T + span),
                      ("first_slot", K + span), ("len_q", [extra]), ("len_k", [extra])):
        arrays[key] = np.concatenate([arrays[key], np.asarray(tail, np.int64)])


def _to_device(arrays: dict[str, np.ndarray], device) -> VarlenRows:
    """Every index array goes over in ONE host->device copy (a copy per array is ~10 launches and
    syncs more per update)."""
    extra_slots = arrays["extra_slots"]
    parts = {**{k: v for k, v in arrays.items() if k not in ("len_q", "len_k", "extra_slots")},
             "cu_q": _cumulative(arrays["len_q"]), "cu_k": _cumulative(arrays["len_k"]),
             "extra_slots": extra_slots.reshape(-1)}
    flat = torch.from_numpy(np.concatenate([v.astype(np.int64, copy=False) for v in parts.values()])).to(device)
    t = dict(zip(parts, flat.split([len(v) for v in parts.values()])))
    slots = SlotMap(first_slot=t["first_slot"], extra_tokens=t["extra_tokens"],
                    extra_slots=t["extra_slots"].view(extra_slots.shape))
    return VarlenRows(input_ids=t["input_ids"], position_ids=t["position_ids"], key_index=t["key_index"],
                      cu_q=t["cu_q"].int(), cu_k=t["cu_k"].int(), max_q=int(arrays["len_q"].max()),
                      max_k=int(arrays["len_k"].max()), state_index=t["state_index"], token_index=t["token_index"],
                      targets=t["targets"], slots=slots)


def _cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def _prompt_groups(ids: np.ndarray, prompt_mask: np.ndarray) -> list[list[int]]:
    """Rows grouped by identical prompt (ids and mask), in order of first appearance."""
    index: dict[bytes, int] = {}
    groups: list[list[int]] = []
    for row in range(len(ids)):
        key = ids[row].tobytes() + prompt_mask[row].tobytes()
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        groups[index[key]].append(row)
    return groups


def varlen_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                pad_multiple: int = 1) -> Optional[VarlenRows]:
    """The varlen layout of a padded batch, or None when a row's response is not a contiguous
    prefix of its response region or a prompt is empty (then only the padded layout is faithful).
    ``pad_multiple``: pad T up to a multiple (bucketed shapes for torch.compile)."""
    lengths = response_lengths(attention_mask, prompt_length)
    if lengths is None:
        return None
    P = prompt_length
    ids, mask = input_ids.cpu().numpy().astype(np.int64, copy=False), attention_mask.cpu().numpy()
    prompt_mask = mask[:, :P].astype(bool)
    groups = _prompt_groups(ids[:, :P], prompt_mask)
    first = np.array([g[0] for g in groups], dtype=np.int64)
    prompt_len = prompt_mask[first].sum(1).astype(np.int64)
    if (prompt_len == 0).any():
        return None
    rows = np.array([r for g in groups for r in g], dtype=np.int64)
    group_of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    arrays = _layout_arrays(ids[first, :P][prompt_mask[first]], prompt_len, group_of, rows, ids[rows, P:],
                            lengths.cpu().numpy().astype(np.int64)[rows], ids.shape[1] - P)
    _pad_layout(arrays, max(1, pad_multiple))
    return _to_device(arrays, input_ids.device)


def varlen_rows_of_groups(groups: list[tuple[list[int], list[list[int]]]], pad_multiple: int = 1,
                          device="cpu") -> VarlenRows:
    """The layout of (prompt, [response, ...]) groups (distinct prompts), rows numbered in order
    and padded to the longest response: for tests and the kernel probe."""
    from asyncrl.training.batch import pad_prompt_response

    prompts = [prompt for prompt, responses in groups for _ in responses]
    responses = [response for _, rs in groups for response in rs]
    ids, attention, _, P = pad_prompt_response(prompts, responses, 0)
    return varlen_rows(ids.to(device), attention.to(device), P, pad_multiple)


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
    out = masked_sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
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
        rows = varlen_rows_of_groups([([1, 2, 3, 4, 5], [[6, 7, 8], [9, 10]])], device=device)
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
