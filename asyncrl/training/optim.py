"""AdamW for the trainer's roles, fused into one kernel per step where torch allows it.

The plain (for-loop) AdamW launches ~10 small ops per parameter tensor: on the quickstart's
0.79M-parameter Qwen3 (46 tensors) that is ~11 ms per optimizer step on one CPU thread,
against ~0.8 ms fused (bench/RESULTS.md, issue 8). The update rule is the same (Loshchilov &
Hutter decoupled weight decay, bias-corrected moments); only the summation order of the
arithmetic differs, so results agree to float rounding. HF Trainer (and so TRL) picks the
fused implementation too.
"""
from __future__ import annotations

from typing import Iterable

import torch

_FUSED_DEVICES = ("cpu", "cuda")


def supports_fused(params: list[torch.Tensor]) -> bool:
    """True when every parameter is a floating tensor on a device with a fused AdamW kernel."""
    return bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params)


def adamw(params: Iterable[torch.Tensor], lr: float, betas=(0.9, 0.999), weight_decay: float = 0.01) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params``, fused when :func:`supports_fused` (else the default)."""
    params = list(params)
    fused = supports_fused(params) or None  # None: torch's own default (foreach on CUDA, loop on CPU)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused)


OFFLOAD_MODES = ("none", "optimizer", "full")


def build_optimizer(params: Iterable[torch.Tensor], actor_cfg) -> torch.optim.Optimizer:
    """The AdamW of a trained role: its moments in host memory with ``offload=optimizer``
    (host_adamw.py), else :func:`adamw` (``full`` offload keeps the whole optimizer on the
    CPU through FSDP2, so it is a plain AdamW there too)."""
    betas = getattr(actor_cfg, "betas", (0.9, 0.999))  # the critic's config has no betas: torch's defaults
    if getattr(actor_cfg, "offload", "none") == "optimizer":
        from asyncrl.training.host_adamw import HostAdamW

        return HostAdamW(params, lr=actor_cfg.lr, betas=betas, weight_decay=actor_cfg.weight_decay)
    return adamw(params, lr=actor_cfg.lr, betas=betas, weight_decay=actor_cfg.weight_decay)
