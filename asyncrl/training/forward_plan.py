"""How the trainer's forward runs on one model: kernels, layout, compile (``actor.kernels``,
``actor.packing``, ``actor.compile``).

``prepare_model`` resolves the config against the model and the machine once, changes the model
in place where a choice needs it (Liger's modules, compiled blocks: class swaps that keep
parameter names, hooks, ``deepcopy`` and FSDP2's later ``fully_shard``), and attaches the
resulting ``ForwardPlan``; every role that runs the model (actor, the reference's copy, the
critic, log-prob probes) reads it back through ``plan_of``, so they all take the same path.

Invariant: every plan computes the eager path's log-probs, entropies and gradients to rounding
(tests/training/test_forward_plan.py, test_varlen.py); plans differ only in speed and memory.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from asyncrl.training import kernels as kernel_lib
from asyncrl.training import varlen
from asyncrl.training.fused_attention import ARCHITECTURES as FUSED_ARCHITECTURES
from asyncrl.training.fused_attention import fused_attention_unsupported_reason

PACKING_CHOICES = ("auto", "varlen", "tree", "padded")
_ATTR = "_asyncrl_forward_plan"
_log = logging.getLogger(__name__)


@dataclass
class ForwardPlan:
    """The resolved forward of one model.

    body: "eager" (HF modules), "liger" (Liger's RMSNorm/RoPE/SwiGLU) or "compiled" (HF modules,
    decoder blocks under torch.compile). head: the LM head's row kernel, "torch" or "triton"
    (triton_head.py). layout: "varlen" (GPU, varlen.py), "tree" (the prefix tree under a 4D mask
    for short rows, packing.py; padded otherwise) or "padded" (the prompt's KV shared per group).
    attention: "hf" (HF's attention modules through the attention interface) or "fused" (the
    liger body in the varlen layout on CUDA, a Qwen3 model: fused_attention.py's [T, H, D] forward
    with the Triton q/k RMSNorm + RoPE, and the Triton RMSNorm for the hidden states).
    notes: why a requested or automatic choice fell back.
    """

    body: str = "eager"
    head: str = "torch"
    layout: str = "tree"
    attention: str = "hf"
    notes: list[str] = field(default_factory=list)

    @property
    def pad_multiple(self) -> int:
        from asyncrl.training.compile import PAD_MULTIPLE
        return PAD_MULTIPLE if self.body == "compiled" else 1

    def describe(self) -> str:
        fused = " attention=fused (Triton RMSNorm, q/k RMSNorm + RoPE on [T, H, D])" \
            if self.attention == "fused" else ""
        return f"body={self.body} head={self.head} layout={self.layout}{fused}" + \
            (f" ({'; '.join(self.notes)})" if self.notes else "")


def plan_of(model) -> ForwardPlan:
    """The plan ``prepare_model`` attached, or the CPU default (eager body, torch head, tree layout)."""
    return getattr(model, _ATTR, None) or ForwardPlan()


def _resolve_layout(choice: str, model, device, dtype, notes: list[str]) -> str:
    if choice not in PACKING_CHOICES:
        raise ValueError(f"actor.packing must be one of {PACKING_CHOICES}, got {choice!r}")
    if choice in ("tree", "padded"):
        return choice
    if choice == "auto" and device.type != "cuda":
        return "tree"  # the CPU default: short rows under the 4D mask, long rows padded
    reason = varlen.varlen_supported(model)
    if reason is None and device.type == "cuda":
        reason = varlen.probe_flash(device, dtype) if dtype in (torch.bfloat16, torch.float16) else \
            f"a {dtype} model (FlashAttention's varlen kernel takes bf16/fp16)"
    if reason is None:
        return "varlen"
    if choice == "varlen" and varlen.varlen_supported(model) is not None:
        raise ValueError(f"actor.packing=varlen: {reason}")
    if choice == "varlen":  # the layout works with the dense reference attention (CPU, fp32): slow but exact
        notes.append(f"varlen attention by the dense reference ({reason})" if device.type == "cuda" else
                     "varlen attention by the dense reference (CPU)")
        return "varlen"
    notes.append(f"varlen layout off: {reason}")
    return "tree"


def _fused_attention(model, layout: str, device, notes: list[str]) -> bool:
    """Whether the liger body also takes fused_attention.py (varlen layout on CUDA, Triton, a
    Qwen3 model with the default RoPE), unless ``ASYNCRL_FUSED_ATTENTION=0``. On by default since
    it measured faster on an H200 (update 0.441 -> 0.424 s in one process, 2026-12-03:
    bench/trainer_update_ab.py --fused-attention; bench/RESULTS.md, issue 20)."""
    if layout != "varlen" or device.type != "cuda" or not kernel_lib.triton_available():
        return False
    if os.environ.get("ASYNCRL_FUSED_ATTENTION", "1") != "1":
        return False  # turned off by the user: no note
    reason = fused_attention_unsupported_reason(model)
    if reason is not None and getattr(model.config, "model_type", None) in FUSED_ARCHITECTURES:
        notes.append(f"fused attention off: {reason}")  # other architectures: Liger's modules, nothing to say
    return reason is None


def prepare_model(model, kernels: str = "auto", packing: str = "auto", compile_blocks: bool = False,
                  device=None, dtype=None) -> ForwardPlan:
    """Resolves ``actor.kernels`` / ``actor.packing`` / ``actor.compile`` for ``model`` (on its
    device already, or the ``device`` / compute ``dtype`` it will run in: the sharded trainer
    prepares the model before its shards are cut and moved), applies them, attaches and returns
    the plan. ValueError (one line, naming the cause) for an explicit choice that cannot run here."""
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    dtype = dtype or param.dtype
    notes: list[str] = []
    attention = "hf"
    resolved = kernel_lib.resolve_kernels(kernels, model, notes, device)
    layout = _resolve_layout(packing, model, device, dtype, notes)
    head = "triton" if kernels != "eager" and device.type == "cuda" and kernel_lib.triton_available() else "torch"
    if compile_blocks:
        from asyncrl.training.compile import compile_decoder_blocks
        compile_decoder_blocks(model)
        body = "compiled"  # Inductor fuses the blocks' elementwise ops itself: Liger's modules not applied
        if resolved == "liger":
            notes.append("compile: Liger's block kernels replaced by Inductor's")
    elif resolved == "liger":
        fused = _fused_attention(model, layout, device, notes)
        kernel_lib.apply_liger(model, fused_attention=fused)
        body, attention = "liger", "fused" if fused else "hf"
    else:
        body = "eager"
    plan = ForwardPlan(body=body, head=head, layout=layout, attention=attention, notes=notes)
    setattr(model, _ATTR, plan)
    _log.info("trainer forward: %s", plan.describe())
    return plan


def prepare_like(model, plan: ForwardPlan, device=None, dtype=None) -> ForwardPlan:
    """Applies to ``model`` (the critic, built from the policy's config) the choices that
    produced ``plan`` (the policy's)."""
    kernels = "liger" if plan.body == "liger" else ("eager" if plan.head == "torch" and plan.body == "eager" else "auto")
    return prepare_model(model, kernels, plan.layout, plan.body == "compiled", device, dtype)
