"""Qwen3 attention for the varlen layout that keeps q/k/v in [T, H, D] from the projections to the
varlen kernel, and the Triton RMSNorm for the hidden states (issue 20).

HF's ``Qwen3Attention.forward`` computes ``q_norm(q_proj(x).view(1, T, H, D)).transpose(1, 2)``
(and k, v alike), applies RoPE on [1, H, T, D] and hands the attention interface transposed
views. In backward, autograd materializes each of those views: ``select``'s backward (the
interface's ``query[0]``) writes the gradient into a zeroed [1, H, T, D] buffer ([16 | 8, T, 128]
copies for q, k and v), Liger's RoPE backward makes the transposed gradient contiguous again
([1, T, 16 | 8, 128]) and v's ``view``'s backward reshapes a transposed gradient (another
[1, T, 8, 128]): 21.6 ms per update at the peer shape on the H200. Here:

    q = qk_norm_rope(q_proj(x).view(T, H, D))          one Triton kernel, [T, H, D] in and out
    k = qk_norm_rope(k_proj(x).view(T, Hkv, D));  v = v_proj(x).view(T, Hkv, D)
    o = o_proj(varlen.attend(q, k[key_index], v[key_index]).view(T, H * D))

with the angles from the layout's ``position_ids`` and the model's own ``rotary_emb.inv_freq``
(default RoPE only: HF's rotary embedding for it is ``position * inv_freq``, scaling 1). The
module is swapped in per instance like Liger's (kernels.py), only for a Qwen3 model in the
``liger`` body with the varlen layout on CUDA; any call without the varlen layout (no rows in
the kwargs: a padded forward, a KV cache) runs HF's forward unchanged.
"""
from __future__ import annotations

import torch

from asyncrl.training import varlen
from asyncrl.training.varlen_gather import gather_key_slots

ARCHITECTURES = ("qwen3",)  # q_norm / k_norm per head_dim on the projections' per-head view


def fused_attention_unsupported_reason(model) -> str | None:
    """Why the fused attention cannot replace ``model``'s (None: it can)."""
    config = model.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {list(ARCHITECTURES)}"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        return f"rope_type {rope_type!r} (the fused kernel computes the default RoPE only)"
    rotary = _rotary(model)
    if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0 \
            or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return "no rotary embedding module with inv_freq and scaling 1"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2 or rotary.inv_freq.numel() != head_dim // 2:
        return f"RoPE on {2 * rotary.inv_freq.numel()} of head_dim {head_dim} dims (the kernel rotates all, in halves)"
    return varlen.varlen_supported(model)


def _rotary(model):
    """The decoder's one rotary embedding module (found by class name: a PEFT wrapper nests it)."""
    return next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)


def gather_kv(k: torch.Tensor, v: torch.Tensor, rows: varlen.VarlenRows) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, Hkv, D] -> the sequences' key/value slots [K, Hkv, D] (``rows.key_index``), through the
    same gather as ``varlen.varlen_attention`` (its backward sums a prompt token's slots without atomics)."""
    return (gather_key_slots(k, rows.key_index, rows.slots), gather_key_slots(v, rows.key_index, rows.slots))


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """hidden_states [1, T, hidden] in the varlen layout -> ([1, T, hidden], None); HF's forward
    for any other call."""
    from asyncrl.training.triton_qk_norm_rope import qk_norm_rope

    rows = kwargs.get(varlen.KWARG)
    if rows is None or cache is not None or kwargs.get("past_key_values") is not None \
            or not _one_dtype(self, hidden_states):
        return type(self)._asyncrl_base.forward(self, hidden_states, position_embeddings, attention_mask,
                                                cache=cache, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"the varlen layout is one sequence of tokens, got a batch of {hidden_states.shape[0]}")
    x, D = hidden_states[0], self.head_dim
    T = x.shape[0]
    inv_freq = self.__dict__["_asyncrl_rotary"].inv_freq.float()  # HF's own buffer, as its rotary reads it
    q = qk_norm_rope(self.q_proj(x).view(T, -1, D), self.q_norm.weight, self.q_norm.variance_epsilon,
                     rows.position_ids, inv_freq)
    k = qk_norm_rope(self.k_proj(x).view(T, -1, D), self.k_norm.weight, self.k_norm.variance_epsilon,
                     rows.position_ids, inv_freq)
    k_slots, v_slots = gather_kv(k, self.v_proj(x).view(T, -1, D), rows)
    out = varlen.attend(q, k_slots, v_slots, rows, self.scaling)  # [T, H, D]
    return self.o_proj(out.reshape(T, -1))[None], None


def _one_dtype(self, hidden_states) -> bool:
    """The projections and q/k norms compute in the activations' dtype (no autocast, no norm kept
    in fp32): the kernel writes x's dtype where HF would promote."""
    dtypes = {hidden_states.dtype, self.q_proj.weight.dtype, self.q_norm.weight.dtype, self.k_norm.weight.dtype}
    return len(dtypes) == 1 and not torch.is_autocast_enabled(hidden_states.device.type)


def _triton_rms_norm_forward(self, hidden_states):
    """HF's RMSNorm by the Triton kernel; HF's own forward where the kernel does not apply (a
    weight in another dtype than the activations: HF promotes the output, the kernel does not)."""
    from asyncrl.training.triton_qk_norm_rope import rms_norm, unsupported_reason
    if unsupported_reason(hidden_states, self.weight) is not None:
        return type(self)._asyncrl_base.forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def is_qwen3_attention(module) -> bool:
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")) \
        and hasattr(module, "head_dim") and hasattr(module, "scaling")


def install(model, swap_class) -> int:
    """Swaps every Qwen3 attention of ``model`` to ``_fused_forward`` (``swap_class``: kernels.py's
    per-instance class swap); returns how many. The model's rotary embedding is referenced from
    each attention's ``__dict__`` (not a submodule: parameters, buffers and names unchanged)."""
    rotary = _rotary(model)
    swapped = 0
    for module in model.modules():
        if is_qwen3_attention(module):
            swap_class(module, _fused_forward, "Fused")
            module.__dict__["_asyncrl_rotary"] = rotary
            swapped += 1
    return swapped
