"""Liger Kernel's fused RMSNorm, RoPE and SwiGLU on an HF decoder, per architecture.

HF's eager bf16 modules cost a GPU actor update ~18k kernel launches, most of them elementwise
(RMSNorm's fp32 round trip, RoPE's rotate_half, SiLU * up): bench/RESULTS.md, issue 8. Liger
Kernel (the library TRL, verl and OpenRLHF use for this) has one Triton kernel for each, forward
and backward. This module puts them into a model that is already built:

- RMSNorm and SwiGLU modules get a subclass whose ``forward`` calls Liger's autograd Functions
  (the class is swapped per instance, as FSDP2's ``fully_shard`` does: parameters, their names,
  hooks and ``deepcopy`` are unchanged, so a model that ``fully_shard`` wraps later, or the
  reference copy of it, keeps the kernels).
- RoPE is a module-level function in HF's modeling files (no module to swap), so the function
  is replaced by a dispatcher that calls Liger's kernel only for CUDA tensors inside
  :func:`liger_rope_enabled` (entered by the trainer's forward of a Liger model) and HF's own
  function otherwise: other models in the process (an eager reference, a CPU model, the HF
  rollout backend) keep HF's RoPE.

A Qwen3 model in the varlen layout on CUDA takes more (:func:`apply_fused_attention`; off with
``ASYNCRL_FUSED_ATTENTION=0``): the
RMSNorms run triton_qk_norm_rope.py's kernel and the attention modules fused_attention.py's
[T, H, D] forward (q/k RMSNorm + RoPE in one kernel, no layout copies); issue 20.

Architectures are listed explicitly (``LIGER_ARCHITECTURES``): a Qwen3.5 norm computes
``x * (1 + w)`` and a Gemma norm differs again, so an unlisted ``model_type`` is never patched
(``actor.kernels=auto`` keeps it eager; ``liger`` refuses it with a clear error).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib
import importlib.util
import os

import torch

from asyncrl.training import fused_attention as fused_attention_lib
from asyncrl.training import hf_functions

KERNEL_CHOICES = ("auto", "liger", "eager")
# model_type -> HF modeling module whose RMSNorm (x * w, llama casting), SwiGLU MLP and
# apply_rotary_pos_emb match Liger's kernels (Liger's own monkey_patch.py does the same for these).
LIGER_ARCHITECTURES = {
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
}
_LIGER_ROPE = contextvars.ContextVar("asyncrl_liger_rope", default=False)
_SWAPPED: dict[tuple[type, str], type] = {}


def liger_available() -> bool:
    """Liger Kernel and Triton are importable (pip install liger-kernel; Triton comes with CUDA torch)."""
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def liger_unsupported_reason(model, device=None) -> str | None:
    """Why Liger's kernels cannot run on ``model`` (None: they can); ``device``: where it will run
    (default: where its parameters are; the sharded trainer prepares a model before moving it)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model_type = getattr(model.config, "model_type", None)
    if model_type not in LIGER_ARCHITECTURES:
        return f"model_type {model_type!r} is not one of {sorted(LIGER_ARCHITECTURES)}"
    if getattr(model.config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {model.config.hidden_act!r} is not SiLU"
    if device.type != "cuda":
        return "the model is not on a CUDA device (Liger's kernels are Triton GPU kernels)"
    if not liger_available():
        return "liger-kernel is not installed (pip install liger-kernel)"
    return probe_liger(device)


def probe_liger(device) -> str | None:
    """Runs Liger's three kernels once on ``device`` (bf16, forward and backward) against HF's
    formulas; returns why they cannot be used (None: they match). Guards against a liger-kernel
    release that does not run with this torch / triton."""
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction
        g = torch.Generator().manual_seed(0)
        x, a, b = (torch.randn(2, 8, 64, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
        w = torch.rand(64, generator=g).to(device, torch.bfloat16)
        ref_norm = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        q = torch.randn(1, 4, 8, 64, generator=g).to(device, torch.bfloat16)
        k = torch.randn(1, 2, 8, 64, generator=g).to(device, torch.bfloat16)
        angle = torch.randn(1, 8, 32, generator=g).to(device)
        cos, sin = (torch.cat([f(angle)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        rotate = lambda t: torch.cat([-t[..., 32:], t[..., :32]], -1)  # noqa: E731
        ref_swiglu, ref_rope = torch.nn.functional.silu(a) * b, q * cos[:, None] + rotate(q) * sin[:, None]
        pairs = [(LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False), ref_norm),  # refs first: the
                 (LigerSiLUMulFunction.apply(a, b), ref_swiglu),  # kernels may write into their inputs
                 (LigerRopeFunction.apply(q.clone(), k.clone(), cos, sin, None, 1)[0], ref_rope)]
        for ours, ref in pairs:
            if not torch.allclose(ours.float(), ref.float(), atol=5e-2, rtol=5e-2):
                return f"Liger's kernels differ from HF's formulas by {float((ours.float() - ref.float()).abs().max()):.3g}"
        torch.autograd.grad(sum(o.float().sum() for o, _ in pairs[:2]), (x, a, b))
    except Exception as exc:  # noqa: BLE001 -- any failure means: keep HF's modules
        return f"Liger's kernels failed here: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def resolve_kernels(choice: str, model, notes: list | None = None, device=None) -> str:
    """``actor.kernels`` -> "liger" or "eager". auto: Liger where it runs, else HF's modules (on a
    GPU the reason goes to ``notes``); liger: Liger or a ValueError naming the reason."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"actor.kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "eager":
        return "eager"
    reason = liger_unsupported_reason(model, device)
    if reason is None:
        return "liger"
    if choice == "liger":
        raise ValueError(f"actor.kernels=liger: {reason}; use actor.kernels=auto or eager")
    on_gpu = (torch.device(device) if device is not None else next(model.parameters()).device).type == "cuda"
    if notes is not None and on_gpu:
        notes.append(f"Liger off: {reason}")
    return "eager"


def _reduce_as_base(self, protocol):
    """Pickled (e.g. to the rollout process) as the class it was swapped from: the subclass is
    made at run time, so another process could not import it, and kernels are the trainer's."""
    return _new_of, (type(self)._asyncrl_base,), self.__getstate__()


def _new_of(cls):
    return cls.__new__(cls)


def _deepcopy_keeping_class(self, memo):
    """``deepcopy`` (the reference model, the rollout clone) keeps the swapped class."""
    clone = type(self).__new__(type(self))
    memo[id(self)] = clone
    clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
    return clone


def _swap_class(module: torch.nn.Module, forward, tag: str) -> None:
    """Gives ``module`` a cached subclass of its class with ``forward`` (FSDP2's own technique)."""
    base = type(module)
    if getattr(base, "_asyncrl_kernel", None) == tag:
        return
    key = (base, tag)  # one subclass per class and tag: compiled forwards are shared by all blocks
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"{tag}{base.__name__}", (base,), {
            "forward": forward, "_asyncrl_kernel": tag, "_asyncrl_base": getattr(base, "_asyncrl_base", base),
            "__reduce_ex__": _reduce_as_base, "__deepcopy__": _deepcopy_keeping_class})
    module.__class__ = _SWAPPED[key]


def _liger_rms_norm_forward(self, hidden_states):
    # casting "llama": inverse RMS in fp32, then w * x in the input dtype (HF's Qwen3/Llama RMSNorm);
    # not in place: the incoming gradient may be shared with the residual branch. The backward is
    # triton_rms_norm's (a grid sized for the trainer's row counts) unless ASYNCRL_LIGER_RMS_BACKWARD=1
    # (Liger's own, for A/B: bench/trainer_rms_norm.py)
    if os.environ.get("ASYNCRL_LIGER_RMS_BACKWARD") == "1":
        from liger_kernel.ops import LigerRMSNormFunction as function
    else:
        from asyncrl.training.triton_rms_norm import wide_rms_norm_function
        function = wide_rms_norm_function()
    return function.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _liger_swiglu_forward(self, x):
    from liger_kernel.ops import LigerSiLUMulFunction
    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
        and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_swiglu(module) -> bool:
    return all(isinstance(getattr(module, name, None), torch.nn.Linear)
               for name in ("gate_proj", "up_proj", "down_proj")) and not hasattr(module, "experts")


def _install_rope_dispatcher(modeling_module: str) -> None:
    """Puts a dispatcher in front of ``apply_rotary_pos_emb`` in the model's HF modeling module, once
    (Liger for CUDA tensors inside :func:`liger_rope_enabled`, HF's function otherwise;
    ``hf_functions.replace``: a plain function or transformers 5.25's hub-kernel module alike)."""
    def dispatcher(original):
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            if _LIGER_ROPE.get() and q.is_cuda and not args and kwargs.get("unsqueeze_dim", 1) == 1:
                from liger_kernel.ops import LigerRopeFunction
                return LigerRopeFunction.apply(q, k, cos, sin, None, 1)
            return original(q, k, cos, sin, *args, **kwargs)
        return apply_rotary_pos_emb

    hf_functions.replace(importlib.import_module(modeling_module), "apply_rotary_pos_emb", dispatcher)


def apply_liger(model, fused_attention: bool = False) -> int:
    """Swaps ``model``'s RMSNorm and SwiGLU modules to Liger's kernels and installs the RoPE
    dispatcher for its architecture; returns the number of modules swapped. MoE expert blocks
    are left alone (routing hooks and packed experts stay HF's). ``fused_attention`` (a Qwen3
    model in the varlen layout on CUDA): :func:`apply_fused_attention` instead of Liger's norms."""
    _install_rope_dispatcher(LIGER_ARCHITECTURES[model.config.model_type])
    swapped = 0
    for module in model.modules():
        if _is_swiglu(module):
            _swap_class(module, _liger_swiglu_forward, "Liger")
            swapped += 1
    if fused_attention:
        return swapped + apply_fused_attention(model)
    return swapped + _swap_norms(model, _liger_rms_norm_forward, "Liger")


def apply_fused_attention(model) -> int:
    """The RMSNorms get the Triton kernel of triton_qk_norm_rope.py (Liger's backward is ~5x off
    bandwidth at [36736, 1024]) and the attention modules fused_attention.py's [T, H, D] varlen
    forward with the fused q/k RMSNorm + RoPE; returns the number of modules swapped."""
    swapped = _swap_norms(model, fused_attention_lib._triton_rms_norm_forward, "Triton")
    return swapped + fused_attention_lib.install(model, _swap_class)


def _swap_norms(model, forward, tag: str) -> int:
    norms = [module for module in model.modules() if _is_rms_norm(module)]
    for module in norms:
        _swap_class(module, forward, tag)
    return len(norms)


def liger_rope_active() -> bool:
    return _LIGER_ROPE.get()


@contextlib.contextmanager
def liger_rope_enabled(enabled: bool = True):
    """Within: RoPE of CUDA tensors in patched architectures runs Liger's kernel."""
    token = _LIGER_ROPE.set(enabled)
    try:
        yield
    finally:
        _LIGER_ROPE.reset(token)
