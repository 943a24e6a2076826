"""A prompt's cache handed to its rows, differentiably, for full-attention and hybrid models.

The trainer runs each distinct prompt once and continues its n responses from the prompt's
cache (logprobs.py, ``_shared_prefix_states``). For full-attention layers the cache is keys and
values [G, heads, P, D]; for Qwen3.5's Gated DeltaNet layers (transformers'
``LinearAttentionLayer``) it is the short conv's last inputs [G, C, W] and the delta rule's state
[G, HV, K, V]. :func:`broadcast_prompt_cache` indexes every one of them to the B rows, so the
response pass reads its prompt's state and gradients flow back into the prompt pass.

transformers' linear-attention layer writes the new recurrent state *in place* into the tensor
the response pass just read (``copy_``, to keep a static address for CUDA graphs); autograd has
saved that tensor for the backward of the delta rule, so the backward would fail ("modified by an
inplace operation"). :class:`RowStateLayer` (a subclass, swapped in like forward_plan.py's
classes) stores the new states by assignment instead: the prompt's states stay intact.
"""
from __future__ import annotations

import torch

try:  # transformers >= 5 (Qwen3.5): the cache layer of linear-attention (Gated DeltaNet, Mamba) models
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # pragma: no cover - older transformers has no hybrid models
    LinearAttentionLayer = None


if LinearAttentionLayer is not None:
    class RowStateLayer(LinearAttentionLayer):
        """A linear-attention cache layer whose updates assign the new conv/recurrent states
        (returned as transformers' layer returns them) rather than copying into the old ones."""

        def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
            self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx]:]
            return full

        def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
            self.recurrent_states[state_idx] = recurrent_states
            return recurrent_states


def is_linear_layer(layer) -> bool:
    return LinearAttentionLayer is not None and isinstance(layer, LinearAttentionLayer)


def broadcast_prompt_cache(cache, inverse: torch.Tensor) -> None:
    """Index every layer of ``cache`` (filled by a forward over G distinct prompts) to B rows:
    row b continues prompt ``inverse[b]`` (``inverse`` [B] long). In place on ``cache``;
    differentiable (``index_select``)."""
    for layer in cache.layers:
        if is_linear_layer(layer):
            for i in range(layer.number_of_states):
                if not layer.has_previous_state[i]:
                    raise ValueError("the prompt pass left a linear-attention layer without a state")
                layer.conv_states[i] = layer.conv_states[i].index_select(0, inverse)
                layer.recurrent_states[i] = layer.recurrent_states[i].index_select(0, inverse)
            layer.__class__ = RowStateLayer
        else:
            layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
