"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper and newer.

Why: a decode step of workload (a) on an H200 is ~330 kernels replayed from one CUDA graph, and the device sat
idle ~0.3 ms of each ~4.3 ms step between them (``bench/decode_timeline.py``, 2026-12-04 session 48): each kernel
boundary costs the next grid's launch (~0.5-1 us) after the previous one has drained. A kernel launched with PDL
(``launch_pdl=True``: the launch attribute ``PROGRAMMATIC_STREAM_SERIALIZATION``, kept as a programmatic edge when
a CUDA graph captures it) may start while the kernel before it finishes; it must then wait with
``griddepcontrol.wait`` (``gdc_wait``) before it reads anything that kernel wrote. The wait blocks until the
previous grid has completed and its memory is visible, so the results are those of plain launches.

The invariant every PDL kernel keeps: ``wait_for_producer(USE_PDL)`` comes before its first load of a tensor that
an earlier kernel of the step writes (activations, the K/V cache, logits). Loads before it may only read step
inputs copied from the host before the step's first kernel: every chain of PDL kernels starts after a plain
launch (a cuBLAS GEMM, a torch kernel), which started only once all work before it had completed.

cuBLAS's GEMMs are launched by cuBLAS, without the attribute, so only the boundaries into a Triton kernel can
overlap: GEMM -> q/k norm + RoPE + K/V write -> decode attention, GEMM -> residual add + RMSNorm, GEMM -> SwiGLU,
LM head -> sampler (5 of a decoder layer's 9 boundaries). ``ENABLED`` switches it (benches A/B it; the environment
variable ``ASYNCRL_PDL=0`` turns it off); the Triton interpreter (CPU tests) and pre-Hopper GPUs launch plainly.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3; older ones launch plainly
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

ENABLED = os.environ.get("ASYNCRL_PDL", "1") != "0"  # ASYNCRL_PDL=0: every kernel launches plainly
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: ``ENABLED``, a Triton with ``gdc_wait``, CUDA, compute
    capability >= 9, not the interpreter."""
    if not ENABLED or not HAS_GDC or INTERPRET or device.type != "cuda":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a PDL kernel's launch adds: its ``USE_PDL`` constexpr and, when on, Triton's
    ``launch_pdl`` option (a separate compiled launcher per value)."""
    on = use_pdl(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    """Blocks until the grid launched before this one has completed and its writes are visible (no-op off)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def release_dependents(USE_PDL: tl.constexpr):
    """Lets the next PDL kernel start launching (its programs then wait in ``wait_for_producer``) (no-op off)."""
    if USE_PDL:
        gdc_launch_dependents()
