"""Activation checkpointing whose recomputation runs the kernels the forward ran.

The trainer's forward switches three things for its own duration only: the model's attention
implementation (``varlen.varlen_hidden``: the packed layout's FlashAttention varlen), Liger's
RoPE kernel (``kernels.liger_rope_enabled``, a ContextVar) and a MoE model's replayed routes
(``RoutingReplay.use``). Torch's non-reentrant checkpoint recomputes each decoder layer in
backward, after all three are switched back -- and on CUDA in autograd's own thread, where a
ContextVar holds its default -- so the recomputation took SDPA over the packed tokens and HF's
RoPE (torch's CheckpointError on the H200's FSDP2 step) and natively routed experts (the same
tensor shapes: silently wrong gradients). ``context_fn`` captures the switches as each layer runs
forward and puts them back around its recomputation.
"""
from __future__ import annotations

import contextlib
import functools

from asyncrl.training import kernels, varlen
from asyncrl.training.routing_replay import replay_of


@contextlib.contextmanager
def _as_in_forward(config, attention: str, liger_rope: bool, replay, routes):
    with contextlib.ExitStack() as stack:
        stack.enter_context(varlen.config_implementation(config, attention))
        stack.enter_context(kernels.liger_rope_enabled(liger_rope))
        if replay is not None:
            stack.enter_context(replay.recomputed(routes))
        yield


def checkpoint_contexts(model):
    """torch.utils.checkpoint's ``context_fn`` (called as a layer runs forward): (the forward's
    context: nothing to change, the recomputation's: the switches as they are now)."""
    replay = replay_of(model)
    return contextlib.nullcontext(), _as_in_forward(model.config, model.config._attn_implementation,
                                                    kernels.liger_rope_active(), replay,
                                                    replay.state() if replay is not None else None)


def enable_activation_checkpointing(model) -> None:
    """HF's per-layer activation checkpointing, non-reentrant (the form FSDP2 supports), recomputing
    under the forward's switches; transformers renamed it ``activation_checkpointing_enable`` in 5.2x."""
    options = {"use_reentrant": False, "context_fn": functools.partial(checkpoint_contexts, model)}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
