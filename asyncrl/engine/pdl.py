"""Programmatic dependent launch (PDL) of the fused decode layer's kernels, with each GEMM's weights streamed into
L2 while the kernel before it finishes. Hopper and newer; opt-in (``ENABLED``, off). Timed on an H200 (2026-12-05):
the fused layer chain 1.02x at 256 rows and 1.08x at 64 with it, but that chain is 0.72x the engine's kernels, so
end to end ``gemm_pdl`` ran (a) 0.93x, (c) 0.90x the engine (bench/RESULTS.md, session 53).

Why: at a decode step's few hundred rows each of a layer's GEMMs (``triton_gemm``) reads its weights once, ~4-13 MB
at Qwen3-0.6B's shapes, and only starts reading them when the kernel before it has drained: the weight stream of
each GEMM waits on the GEMM or attention before it, though it depends on nothing they write. A kernel launched
with PDL (Triton's ``launch_pdl``: the launch attribute ``PROGRAMMATIC_STREAM_SERIALIZATION``, which a CUDA graph
keeps as a programmatic edge) may start once every program of the kernel before it has called
``gdc_launch_dependents``; it then issues one bulk L2 prefetch of its weight slice (``prefetch_l2``: a hint, no
register or shared-memory result) and blocks in ``griddepcontrol.wait`` (``gdc_wait``) until that kernel has
completed and its writes are visible. Its results are those of a plain launch.

Session 49 (bench/RESULTS.md) launched the engine's glue kernels with PDL and a wait at their top, nothing
before it: 0.995-0.999x end to end, the ~1 us between a graph's kernels stayed. What differs here is the work
before the wait: the weights, the bulk of a GEMM's bytes, move during the previous kernel's tail.

The invariants every kernel launched with ``USE_PDL`` keeps:
  * before ``gdc_wait`` it reads nothing (an L2 prefetch of weights is a hint: it loads no value, and a line a
    weight update rewrote is rewritten in L2, where later loads find it);
  * it calls ``gdc_launch_dependents`` after its wait, so the kernel after it starts at the earliest when this
    one is past its wait (the kernel two ahead never runs alongside: one weight slice in flight ahead, not more);
  * every kernel launched with PDL waits before its first load, so its completion implies its predecessors'
    (the attention kernel reads the K/V the qkv kernel wrote; the down GEMM the residual the o GEMM wrote).
The Triton interpreter (CPU tests) and pre-Hopper GPUs launch plainly.
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

ENABLED = os.environ.get("ASYNCRL_PDL", "0") == "1"  # opt-in: it only serves the (slower) fused layer path
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# cp.async.bulk.prefetch takes its size in 16-byte units in a 16-bit field (sm90 SASS: UBLKPF.L2 after a shift by
# 4 and a 16-bit pack), so one prefetch covers at most 1 MiB - 16 bytes; longer slices go in chunks of this
PREFETCH_CHUNK = tl.constexpr(1 << 19)


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
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


@triton.jit
def prefetch_l2(ptr, nbytes):
    """One bulk prefetch of ``nbytes`` (> 0, a multiple of 16) at ``ptr`` (16-byte aligned) into L2, issued by
    the program's thread 0 (the asm runs on every thread; the others skip it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(W, row0, rows, K, ELEM_BYTES: tl.constexpr):
    """Prefetches rows ``[row0, row0 + rows)`` of a row-major ``[*, K]`` weight (rows contiguous, ``K *
    ELEM_BYTES`` a multiple of 16, as a TMA-ready weight is) into L2, in ``PREFETCH_CHUNK`` pieces."""
    start = W + row0.to(tl.int64) * K
    total = rows * K * ELEM_BYTES
    for off in range(0, total, PREFETCH_CHUNK):
        prefetch_l2((start.to(tl.pointer_type(tl.int8)) + off), tl.minimum(total - off, PREFETCH_CHUNK))


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """Blocks until the grid before this one has completed and its writes are visible, then lets the next PDL
    kernel start launching (its programs prefetch and wait in turn). No-op off."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
