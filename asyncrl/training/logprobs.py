"""Per-token log-probs and entropy of the responses, with the prompt computed once per group.

GRPO batches hold n responses per prompt. On a GPU plan (forward_plan.py) rows of any length run
in the varlen layout (varlen.py): every prompt once, every response after it, no padding, one
forward with attention by cumulative lengths. Otherwise short rows (each prompt with its rows'
responses within ``PACK_BIN_TOKENS``) run in the packed prefix-tree layout (packing.py) under a
4D mask, and longer rows run padded: the prompt once per distinct prompt, its KV cache broadcast
to the rows (gradients flow back through it), then the responses. In every layout the trainer,
like the rollout engine, pays for each prompt once.

When the logits of the whole micro-batch would be big (a 150k vocabulary), the LM head is fused
(head_logprobs.py: at most ``chunk_tokens`` positions at a time, only per-row statistics kept,
exact gradients of the log-prob and the entropy), so [batch, seq, vocab] logits are never held.
Small ones (the 15-token quickstart vocabulary) take one plain pass: same numbers, fewer ops.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from asyncrl.training.forward_plan import plan_of
from asyncrl.training.head_logprobs import acc_dtype, linear_logprobs
from asyncrl.training.kernels import liger_rope_enabled
from asyncrl.training.packing import PackedRows, pack_rows
from asyncrl.training.prompt_cache import broadcast_prompt_cache
from asyncrl.training.varlen import varlen_hidden, varlen_rows


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so left padding does not shift RoPE. [B, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                   temperature: float, with_entropy: bool):
    """hidden [N, H], targets [N] -> (logprob [N], entropy [N] or empty); softmax math in fp32
    (fp64 for an fp64 model: the tests' reference precision)."""
    logits = F.linear(hidden, weight, bias).to(acc_dtype(hidden)) / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    if not with_entropy:
        return logprob, logprob.new_zeros(0)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_norm - (probs * logits).sum(-1)
    return logprob, entropy


def _cache_kwarg(base) -> str:
    """The KV-cache argument's name: ``cache`` in recent transformers 5 releases, ``past_key_values``
    before (5.17 still uses the old name, so the major version does not decide it)."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shared_prefix_states(base, input_ids, attention_mask, prompt_length: int, inverse: torch.Tensor):
    """Hidden states predicting each response token [B, L, H], running each distinct
    prompt once: prompt KV [G, ...] is expanded to the B rows by ``inverse`` [B]."""
    groups = int(inverse.max()) + 1
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.zeros(groups, dtype=torch.long, device=inverse.device).scatter_(0, inverse, rows)  # a row per prompt
    prompt_mask = attention_mask[first, :prompt_length]  # one row per distinct prompt (any of its rows)
    prompt_out = base(input_ids=input_ids[first, :prompt_length], attention_mask=prompt_mask,
                      position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache_kwarg = _cache_kwarg(base)
    cache = getattr(prompt_out, cache_kwarg)
    broadcast_prompt_cache(cache, inverse)  # the prompt's keys/values (and GDN states) to its rows, differentiably
    positions = position_ids_from_mask(attention_mask)[:, prompt_length:]
    response_hidden = base(input_ids=input_ids[:, prompt_length:], attention_mask=attention_mask,
                           position_ids=positions, use_cache=False, **{cache_kwarg: cache}).last_hidden_state
    last_prompt_state = prompt_out.last_hidden_state[:, -1:, :].index_select(0, inverse)
    return torch.cat([last_prompt_state, response_hidden[:, :-1, :]], dim=1)


PACK_BIN_TOKENS = 128  # packed layout when every prompt + its rows' responses fit in this many tokens
SMALL_LOGITS_BYTES = 64 << 20  # logits of a whole micro-batch under this: no chunking, no checkpoint


def _all_full_attention(model) -> bool:
    """No sliding-window or recurrent (linear-attention, Qwen3.5) layers: the prompt's KV cache is
    all a continuation needs, and a 4D mask alone keeps packed sequences apart. (A recurrent layer
    would need ``cu_seqlens`` in its conv and delta rule: SCALE.md §3.2, the packing pitfall.)"""
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


def _packable(model) -> bool:
    """The packed layout needs a model that honours a custom 4D mask and position ids on every
    layer: sdpa or eager attention, no sliding-window or recurrent layers."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager") and _all_full_attention(model)


def _mask_for(model, attention: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as the attention implementation takes it (eager adds it to the scores)."""
    if model.config._attn_implementation == "sdpa":
        return attention
    return torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill(
        ~attention, torch.finfo(dtype).min)


def _packed_states(model, base, packed: PackedRows) -> torch.Tensor:
    """[N, H] state predicting each real response token, from one forward over the packed bins."""
    dtype = next(model.parameters()).dtype
    hidden = base(input_ids=packed.input_ids, attention_mask=_mask_for(model, packed.attention, dtype),
                  position_ids=packed.position_ids, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.state_index)


def _cache_survives(base) -> bool:
    """False in a training forward under HF activation checkpointing, which drops the KV cache
    (transformers sets ``cache=None`` there): the prompt's cache cannot be shared then."""
    if not (base.training and torch.is_grad_enabled()):
        return True
    return not any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())


def _continues_from_cache(base, response_length: int) -> bool:
    """Whether the responses can continue from the prompt's cache. Not for a hybrid model's
    one-token continuation (transformers' decode path updates the GDN states in place: no
    gradients), nor for a model without any full-attention layer (transformers' mask code asks
    the cache for a KV length it does not have): those rows run padded with their prompts."""
    layer_types = getattr(base.config, "layer_types", None) or ["full_attention"]
    if all(kind == "full_attention" for kind in layer_types):
        return True
    on_cuda = next(base.parameters()).device.type == "cuda"
    if on_cuda and not HYBRID_PROMPT_SHARING_ON_CUDA:
        return False
    return response_length > 1 and "full_attention" in layer_types


# A hybrid model on CUDA continues through FLA's chunked kernel with an initial state: checked only
# by the GPU test tests/training/test_prompt_cache.py (not run yet), so off there until it has
HYBRID_PROMPT_SHARING_ON_CUDA = False


def _padded_states(base, input_ids, attention_mask, prompt_length: int, share_prompts: bool) -> torch.Tensor:
    """[B, L, H] state predicting each response position (padding included)."""
    prompts, inverse = torch.unique(input_ids[:, :prompt_length], dim=0, return_inverse=True)
    if share_prompts and prompts.shape[0] < input_ids.shape[0] and _cache_survives(base) \
            and _continues_from_cache(base, input_ids.shape[1] - prompt_length):
        return _shared_prefix_states(base, input_ids, attention_mask, prompt_length, inverse)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    return hidden[:, prompt_length - 1:-1, :]  # the token at t is predicted by the state at t - 1


def _head(states: torch.Tensor, targets: torch.Tensor, head, temperature: float, chunk_tokens: int,
          with_entropy: bool, row_kernel: str = "torch", fused: bool | None = None):
    """states [N, H], targets [N] -> logprob [N], entropy [N] (or empty). A single plain pass when
    the logits of all N rows are small; else the fused head (head_logprobs.py: no [N, V] logits,
    exact gradients of both outputs) for a bias-free head, or checkpointed chunks of the plain
    formula (``fused=False`` forces them: the reference in tests)."""
    count = states.shape[0]
    vocab = head.weight.shape[0]
    if fused is None and count * vocab * 4 <= SMALL_LOGITS_BYTES:
        return _head_logprobs(states, head.weight, head.bias, targets, temperature, with_entropy)
    if head.bias is None and fused is not False:
        return linear_logprobs(states, head.weight, targets, temperature, chunk_tokens, with_entropy,
                               row_kernel if states.is_cuda else "torch")
    needs_grad = torch.is_grad_enabled() and states.requires_grad
    logprobs, entropies = [], []
    for start in range(0, count, chunk_tokens):
        args = (states[start:start + chunk_tokens], head.weight, head.bias,
                targets[start:start + chunk_tokens], temperature, with_entropy)
        lp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False) if needs_grad else _head_logprobs(*args)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def _scatter_rows(values: torch.Tensor, token_index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[N] values of the real response tokens -> [B, L], 0 past each response."""
    return values.new_zeros(batch * length).index_copy(0, token_index, values).view(batch, length)


def response_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                    share_prompts: bool = True, pack_bin_tokens: int | None = None):
    """The decoder's states predicting each response token, in the plan's layout.

    Returns ``(states [N, H], targets [N], token_index [N] or None)``: with a token index, N
    counts the real response tokens only (packed layouts; ``token_index`` places them in
    [B * L]); without one, N = B * L (the padded layout, padding included)."""
    plan = plan_of(model)
    base = model.get_decoder()
    full_attention = _all_full_attention(model)  # hybrid models: padded, each prompt once (prompt_cache.py)
    if share_prompts and full_attention and plan.layout == "varlen":
        with torch.profiler.record_function("actor/varlen_layout"):  # host work: names it in GPU traces
            rows = varlen_rows(input_ids, attention_mask, prompt_length, plan.pad_multiple)
        if rows is not None:
            with liger_rope_enabled(plan.body == "liger"):
                hidden = varlen_hidden(model, base, rows)
            return hidden.index_select(0, rows.state_index), rows.targets, rows.token_index
    pack_bin_tokens = PACK_BIN_TOKENS if pack_bin_tokens is None else pack_bin_tokens
    packed = pack_rows(input_ids, attention_mask, prompt_length, pack_bin_tokens) \
        if share_prompts and full_attention and pack_bin_tokens > 0 and plan.layout != "padded" and _packable(model) \
        else None
    with liger_rope_enabled(plan.body == "liger"):
        if packed is not None:
            return _packed_states(model, base, packed), packed.targets, packed.token_index
        states = _padded_states(base, input_ids, attention_mask, prompt_length, share_prompts)
    return states.reshape(-1, states.shape[-1]), input_ids[:, prompt_length:].reshape(-1), None


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                      temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False,
                      share_prompts: bool = True, pack_bin_tokens: int | None = None,
                      fused_head: bool | None = None):
    """Log-probs (and entropy) of the response tokens under ``model``, in the layout and with
    the kernels of its forward plan (forward_plan.py; the CPU default when it has none).

    Args:
      input_ids, attention_mask: [B, P + L], prompt left-padded to P, response after it.
      prompt_length: P.
      share_prompts: run each distinct prompt once (same result).
      pack_bin_tokens: use the padding-free packed layout (packing.py) when each prompt with its
        rows' responses fits in this many tokens; 0: always the padded layout; None:
        ``PACK_BIN_TOKENS``. (The varlen layout of a GPU plan packs rows of any length.)
      fused_head: None: the fused LM head whenever the logits would be big; False: checkpointed
        chunks of the plain formula (the reference); True: the fused head always.
    Returns:
      logprobs [B, L] (float32) and entropy [B, L] (zeros if ``with_entropy`` is False).
      Positions past a row's response (attention 0) hold 0 in the packed layouts and an
      unused value in the padded one: callers mask them.
    """
    head = model.get_output_embeddings()
    batch, length = input_ids.shape[0], input_ids.shape[1] - prompt_length
    states, targets, token_index = response_states(model, input_ids, attention_mask, prompt_length, share_prompts,
                                                   pack_bin_tokens)
    lp, ent = _head(states, targets, head, temperature, chunk_tokens, with_entropy, plan_of(model).head, fused_head)
    if token_index is not None:
        logprob = _scatter_rows(lp, token_index, batch, length)
        return logprob, _scatter_rows(ent, token_index, batch, length) if with_entropy else torch.zeros_like(logprob)
    logprob = lp.view(batch, length)
    entropy = ent.view(batch, length) if with_entropy else torch.zeros_like(logprob)
    return logprob, entropy
