"""transformers' kernel routing for Qwen3.5's token mixer, made device-aware.

transformers (5.x) binds Qwen3.5's gated delta rule to flash-linear-attention's Triton kernels
(and its short conv to ``causal-conv1d``) when the package is importable: once, at import, for
every device. A Qwen3.5 model on the CPU then fails inside Triton ("Pointer argument cannot be
accessed from Triton (cpu tensor?)") on any machine that has ``fla-core`` installed for its
GPU: the quickstart's CPU trainer, or a CPU reference next to a GPU engine.

:func:`route_cpu_to_torch_kernels` puts a dispatcher in front of those module functions: CPU
tensors take transformers' own torch implementation (the function the routing wrapper wraps),
everything else the kernel transformers chose. Packed sequences (``cu_seqlens``/``seq_idx``) on
the CPU raise, as transformers does without the kernel package: the torch functions cannot keep
them apart.

On the CPU the chunked delta rule and the conv take the short-row forms of ``gdn_cpu.py``
(transformers' chunked function with the chunk cut to the row length, the conv as shifted
multiply-adds: same results to float rounding, ~4x faster on the trainer's rows);
:func:`transformers_torch_forms` runs transformers' torch functions unchanged instead (the
reference the tests compare with).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Callable

import torch

from asyncrl.training import gdn_cpu
from asyncrl.training.hf_functions import replace, replaced, torch_function_of

_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
              "causal_conv1d_fn", "causal_conv1d_update")


def torch_reference(fn: Callable) -> Callable:
    """transformers' torch implementation behind a kernel-routing wrapper (:func:`torch_function_of`),
    called with only the keyword arguments it accepts (as the wrapper does)."""
    torch_fn = torch_function_of(fn)
    params = inspect.signature(torch_fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return torch_fn

    @functools.wraps(torch_fn)
    def call(*args, **kwargs):
        return torch_fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return call


_short_row_forms = True  # False inside transformers_torch_forms()


@contextlib.contextmanager
def transformers_torch_forms():
    """CPU calls run transformers' torch functions as written (chunks of 64, ``F.conv1d``), not
    the short-row forms: the reference path, for tests and benchmarks."""
    global _short_row_forms
    previous, _short_row_forms = _short_row_forms, False
    try:
        yield
    finally:
        _short_row_forms = previous


def _short_row_form(name: str, torch_fn: Callable) -> Callable | None:
    if name == "torch_chunk_gated_delta_rule":
        return gdn_cpu.short_row_delta_rule(torch_function_of(torch_fn))
    if name == "causal_conv1d_fn":
        return gdn_cpu.causal_conv1d_fn
    return None


def _device_dispatch(name: str, torch_fn: Callable, routed: Callable) -> Callable:
    """CPU tensors -> ``torch_fn`` (or its short-row form), anything else -> ``routed`` (what ran before)."""
    short_fn = _short_row_form(name, torch_fn) or torch_fn

    def dispatch(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.device.type != "cpu":
            return routed(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name}: packed sequences (cu_seqlens) on the CPU: transformers' torch "
                             "implementation cannot keep them apart; unpack them (no sequence packing)")
        return (short_fn if _short_row_forms else torch_fn)(*args, **kwargs)

    return dispatch


def route_cpu_to_torch_kernels() -> int:
    """Install the CPU->torch dispatch on the Qwen3.5 / Qwen3.5-MoE modeling modules (idempotent;
    modules this transformers lacks are skipped). Returns the number of functions wrapped now."""
    wrapped = 0
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in _FUNCTIONS:
            fn = getattr(module, name, None)
            if fn is None or replaced(fn) or torch_function_of(fn) is fn:
                continue  # absent, done already, or not behind a routing wrapper
            wrapped += replace(module, name, functools.partial(_device_dispatch, name, torch_reference(fn)))
    return wrapped
