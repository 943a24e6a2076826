"""The policy's response log-probs as one module call.

``response_logprobs`` (logprobs.py) runs the decoder and reads the LM head's weight directly,
never the HF model's own ``forward``. Under FSDP2 a parameter is only gathered inside the
``forward`` of the module that owns it, so the trainer calls this wrapper instead: it is the
FSDP2 root, whose forward gathers the parameters no layer owns (embeddings, final norm, LM
head) and whose backward reduces their gradients. Unsharded, it adds nothing but a call.
"""
from __future__ import annotations

from typing import Optional

import torch

from asyncrl.training.logprobs import response_logprobs


class PolicyLogprobs(torch.nn.Module):
    """Wraps an HF causal LM as ``policy``; ``forward`` is ``response_logprobs`` of it:
    (logprobs [B, L], entropy [B, L]), in the policy's forward plan (forward_plan.py).

    Invariant: ``named_parameters()`` are the policy's, prefixed ``policy.``."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                temperature: float = 1.0, chunk_tokens: int = 4096, with_entropy: bool = False,
                share_prompts: bool = True, pack_bin_tokens: Optional[int] = None,
                fused_head: Optional[bool] = None):
        logprobs, entropy = response_logprobs(self.policy, input_ids, attention_mask, prompt_length, temperature,
                                              chunk_tokens, with_entropy=with_entropy, share_prompts=share_prompts,
                                              pack_bin_tokens=pack_bin_tokens, fused_head=fused_head)
        # fresh tensors, not views: FSDP2 hooks the root's outputs for its backward, and an
        # in-place op on a returned view would silently drop that hook
        return logprobs.clone(), entropy.clone()
