"""torch.compile of the decoder blocks, one compiled graph shared by every block.

Each block of an HF decoder (norm -> attention -> residual -> norm -> MLP -> residual) is a chain
of small elementwise ops between the matmuls; Inductor fuses them (RMSNorm's fp32 round trip,
RoPE, SiLU * up, the residual adds) into a few Triton kernels, as torchtitan does per block.
The block's class gets a compiled ``forward`` (class swap, as in kernels.py: parameter names,
hooks and FSDP2's later wrapping are unchanged); the attention call itself stays outside the
graph (varlen.attend is ``torch.compiler.disable``d), so the kernel's Python integers
(max lengths) never enter a guard. Shapes: the varlen layout pads its token count to a
multiple of ``PAD_MULTIPLE`` and the graph is compiled with dynamic shapes, so new batch sizes
reuse it; ``compile_stats`` counts the graphs compiled so far (the recompile metric).
"""
from __future__ import annotations

import logging

import torch

from asyncrl.training.kernels import _swap_class

PAD_MULTIPLE = 128  # the varlen token count is padded to this when blocks are compiled
_log = logging.getLogger(__name__)
_FAILED: list[str] = []  # the first compile error, if any: then blocks run eagerly


def _compiled_forward(base_forward):
    compiled = torch.compile(base_forward, dynamic=True)

    def forward(self, *args, **kwargs):
        if _FAILED:
            return base_forward(self, *args, **kwargs)
        try:
            return compiled(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- a compiler failure must not stop training
            _FAILED.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            _log.warning("torch.compile of the decoder block failed; running it eagerly: %s", _FAILED[0])
            return base_forward(self, *args, **kwargs)

    return forward


def compile_decoder_blocks(model) -> int:
    """Gives every decoder block of ``model`` a compiled forward; returns how many. Raises the
    graph cache limit to hold one entry per block, in case a guard tells blocks apart."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder .layers to compile")
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 2 * len(layers) + 8))
    for layer in layers:
        if getattr(type(layer), "_asyncrl_kernel", None) != "Compiled":
            _swap_class(layer, _compiled_forward(type(layer).forward), "Compiled")
    return len(layers)


def compile_stats() -> dict[str, float]:
    """Graphs compiled so far in this process and whether compilation failed (then eager)."""
    from torch._dynamo.utils import counters
    return {"trainer/compiled_graphs": float(counters["stats"]["unique_graphs"]),
            "trainer/compile_failed": float(bool(_FAILED))}
