"""Model FLOPs utilisation of a trainer update: model FLOPs / (seconds x the device's peak).

Model FLOPs count what the rows need as written, the way PaLM (Chowdhery et al. 2022, app. B)
and verl's flops counter count them: each row's real prompt + response tokens through every
matmul (6 N per token for forward + backward, N = the decoder's matmul parameters + the LM head,
the embedding lookup excluded) plus causal attention (6 x layers x heads x head_dim x S^2 per
row of S tokens: QK^T and AV over half the S x S scores, times 3 for the backward). Work the
trainer skips (a group's prompt computed once, the LM head only at response positions, no
padding) is not subtracted, so MFU rewards it, as it does recomputation's absence; the
hardware's own utilisation is lower by that share.
"""
from __future__ import annotations

from typing import Optional

import torch

# Dense (no sparsity) bf16 / fp16 tensor-core peaks from the vendors' datasheets, FLOP/s.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
             "B200": 2250e12, "GH200": 989e12}


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops=None):
    """The device's peak FLOP/s for ``dtype`` matmuls, or None when unknown (CPU, fp32, other GPUs)."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def matmul_params(model) -> int:
    """N: parameters that are matmul weights per token (2-D weights, embedding lookups excluded,
    the LM head included even when tied to the embedding)."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    skip = {id(embed.weight)} if embed is not None else set()
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)
    if head is not None and id(head.weight) in skip:  # tied: the head's matmul still runs
        total += head.weight.numel()
    return total


def update_flops(model, row_tokens: torch.Tensor, passes: float = 3.0,
                 matmul_weights: Optional[int] = None) -> float:
    """Model FLOPs of forward + backward (``passes`` = 3: forward once, backward twice) over
    rows of ``row_tokens`` [B] real tokens each. ``matmul_weights``: ``matmul_params(model)``
    when the caller keeps it (a per-step caller: it walks every parameter)."""
    config = model.config
    attn_width = config.num_attention_heads * getattr(config, "head_dim",
                                                      config.hidden_size // config.num_attention_heads)
    tokens = row_tokens.double()
    n = matmul_params(model) if matmul_weights is None else matmul_weights
    dense = 2.0 * n * float(tokens.sum())
    attention = 2.0 * config.num_hidden_layers * attn_width * float((tokens ** 2).sum())
    return passes * (dense + attention)
