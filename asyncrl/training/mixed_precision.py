"""Master weights: AdamW updates float32 copies of a bf16/fp16 model's parameters.

Why: an early AdamW step moves each weight by about ``lr`` (m̂/√v̂ ≈ ±1). A bf16 weight of
magnitude 0.02 is resolved to 2^-8 of its power of two, ~6e-5, so a 1e-6 step rounds back
to the same value: stepping the bf16 parameters directly, 3 steps at lr 1e-6 changed 1.9% of
a model's weights (float32: 99.97%). Every peer keeps float32 weights for the optimizer
(DeepSpeed's bf16 optimizer and Megatron's main params, which OpenRLHF and verl's Megatron
path use; verl's FSDP path keeps float32 parameters and computes in bf16).

How, without touching the model or the engine:
  * the model keeps its dtype: forward, backward and the rollout engine run bf16 as before;
  * each parameter p gets a float32 master m, the tensor AdamW (and its state) updates;
  * when backward has accumulated p's gradient, a hook adds it into m.grad in float32 and
    frees p.grad: micro-batch gradients accumulate in float32, and the grad norm and
    clipping see float32 gradients (clip the optimizer's parameters, :func:`trained_parameters`);
  * after every optimizer step, m is rounded into p.

Invariant: after every step, ``p == m.to(p.dtype)`` and ``p.grad is None``. The optimizer's
``state_dict`` carries the masters, so a checkpoint resumes them exactly (the HF export holds
the bf16 model, as asked by ``model.dtype``).
"""
from __future__ import annotations

from typing import Iterable

import torch

from asyncrl.training.optim import adamw

MASTER_KEY = "master_weights"


class MasterWeights:
    """The float32 (``dtype``) masters of ``params`` and the hooks that keep them in step."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().to(dtype).clone()) for p in params]
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(m)) for p, m in zip(params, self.masters)]

    @staticmethod
    def _grad_hook(master: torch.nn.Parameter):
        def move_grad(param: torch.Tensor) -> None:
            grad = param.grad
            if master.grad is None:
                master.grad = grad.to(master.dtype)
            else:
                master.grad.add_(grad)
            param.grad = None
        return move_grad

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """``p.copy_(m)`` for every pair, as one ``_foreach_copy_`` per (device, dtype) group
        instead of a kernel launch per parameter (hundreds per step on a real model). The
        rounding is copy_'s (round to nearest even), so ``p == m.to(p.dtype)`` holds as before."""
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for param, master in zip(self.params, self.masters):
            key = (param.device, param.dtype, master.device, master.dtype)
            dst, src = groups.setdefault(key, ([], []))
            dst.append(param)
            src.append(master)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy back after each step; save and restore the masters with the optimizer state."""
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.copy_to_model())
        optimizer.register_state_dict_post_hook(self._save)
        optimizer.register_load_state_dict_pre_hook(self._load)

    def _save(self, optimizer, state_dict: dict) -> dict:
        state_dict[MASTER_KEY] = [m.detach().clone() for m in self.masters]
        return state_dict

    @torch.no_grad()
    def _load(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTER_KEY, None)
        if saved is not None:
            for master, value in zip(self.masters, saved):
                master.copy_(value)
            self.copy_to_model()
        return state_dict


def trainer_adamw(params: Iterable[torch.nn.Parameter], master_dtype: str, lr: float, betas=(0.9, 0.999),
                  weight_decay: float = 0.0, host_moments: bool = False) -> torch.optim.AdamW:
    """AdamW for a trained role: over float32 masters when a parameter's dtype differs from
    ``master_dtype`` (see module doc), else over the parameters themselves. ``host_moments``
    (``actor.offload=optimizer`` in one process): the moments live in host memory (host_adamw.py)."""
    params = [p for p in params if p.requires_grad]
    dtype = getattr(torch, master_dtype)
    if host_moments:
        from asyncrl.training.host_adamw import HostAdamW
        make = lambda ps: HostAdamW(ps, lr=lr, betas=tuple(betas), weight_decay=weight_decay)  # noqa: E731
    else:
        make = lambda ps: adamw(ps, lr=lr, betas=betas, weight_decay=weight_decay)  # noqa: E731
    if all(p.dtype == dtype for p in params):
        return make(params)
    master = MasterWeights(params, dtype)
    optimizer = make(master.masters)
    master.attach(optimizer)
    optimizer.master_weights = master  # for tests and the trained-parameter helper
    return optimizer


def trained_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates (the masters when there are): where gradients are
    to be clipped and checked."""
    return [p for group in optimizer.param_groups for p in group["params"]]
