"""The policy's response log-probs as one module call.

``response_logprobs`` (logprobs.py) runs the decoder and reads the LM head's weight directly,
never the HF model's own ``forward``. Under FSDP2 a parameter is only gathered inside the
``forward`` of the module that owns it, so the trainer calls this wrapper instead: it is the
FSDP2 root, whose forward gathers the parameters no layer owns (embeddings, final norm, LM
head) and whose backward reduces their gradients. Unsharded, it adds nothing but a call.

It is also the one place to swap the actor's forward path (fused kernels, varlen packing).
"""
from __future__ import annotations

import torch

from asyncrl.training.logprobs import response_logprobs


class PolicyLogprobs(torch.nn.Module):
    """Wraps an HF causal LM as ``policy``; ``forward`` returns (logprobs [B, L], entropy [B, L]).

    Invariant: ``named_parameters()`` are the policy's, prefixed ``policy.``."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False,
                entropy_grad: bool = True):
        logprobs, entropy = response_logprobs(self.policy, input_ids, attention_mask, prompt_length, temperature,
                                              chunk_tokens, with_entropy=with_entropy,
                                              share_prompts=self._can_share_prompts(), entropy_grad=entropy_grad)
        # fresh tensors, not views: FSDP2 hooks the root's outputs for its backward, and an
        # in-place op on a returned view would silently drop that hook
        return logprobs.clone(), entropy.clone()

    def _can_share_prompts(self) -> bool:
        """Prompt sharing reuses the prompt's KV cache, which HF's activation checkpointing
        drops in a training forward (transformers sets ``cache=None`` there): then every row
        runs its own prompt."""
        if not (self.training and torch.is_grad_enabled()):
            return True
        return not any(getattr(m, "gradient_checkpointing", False) is True for m in self.policy.modules())
