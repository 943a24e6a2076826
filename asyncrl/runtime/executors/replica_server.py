"""One rollout replica's side, wherever it runs: a process spawned on this host
(``process.py: _child_main``, called over a pipe) or a Ray actor on any node
(``ray_replicas.py: ReplicaActor``, called by Ray). Both launchers hand it the same module and
call the same four methods, so a replica behaves the same whichever launched it.

    generate(prompts, params)  -> the backend's RequestOutputs (several calls may run at once)
    load(version)              -> the backend copies ``model``'s parameters (a push just wrote
                                  them) between two of its steps; returns the version it holds
    probe(key, probe, version) -> the weight-sync probe: the backend's sampled log-probs vs an
                                  HF forward of ``model``
    metrics()                  -> the backend's counters (KV blocks, preemptions, ...)

Invariant: ``model``'s parameters are the weights of the last push (the launcher writes them:
shared tensors, a broadcast buffer, or a state from Ray's object store) and the backend holds
a copy of its own, so a push never lands inside a ``generate``.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch


class ReplicaServer:
    """The backend of one replica and the reference module the probe reads (see module doc)."""

    def __init__(self, model: torch.nn.Module, tokenizer, backend_name: str, version: int, kv_on_update: str,
                 dtype: Optional[torch.dtype], device: str, engine_options: dict):
        self.model = model
        self.backend = build_replica_backend(model, tokenizer, backend_name, version, kv_on_update, dtype, device,
                                             engine_options)
        self._probes: dict = {}  # the trainer's probe objects by key (each keeps its last result for delta)

    def generate(self, prompt_token_ids, params):
        return self.backend.generate(prompt_token_ids, params)

    def load(self, version: int) -> int:
        """Hand the backend what a sync moves, from ``model`` (all of it, a LoRA model's adapters,
        or the merged weights computed here for an engine that merged)."""
        from asyncrl.runtime.weight_sync import rollout_weights

        self.backend.update_weights(rollout_weights(self.model, self.backend), version)
        return self.backend.version

    def probe(self, key, probe, version: int):
        """``probe`` is sent once per replica (None afterwards): it keeps its last result."""
        return self._probes.setdefault(key, probe).check(self.backend, self.model, version)

    def metrics(self) -> dict:
        return dict(getattr(self.backend, "metrics", {}))


def build_replica_backend(model, tokenizer, backend_name, version, kv_on_update, dtype, device, engine_options):
    """The backend owns a copy: the engine copies ``model``'s (shared) tensors into its own
    layout; HF generate gets a private clone, so a push never lands inside a ``generate``."""
    if backend_name == "engine":  # the engine copies the shared tensors onto ``device``; ``model``
        from asyncrl.rollout.engine_backend import EngineBackend  # stays shared (the probe reads it)

        return EngineBackend(model, tokenizer, version=version, dtype=dtype, device=device, kv_on_update=kv_on_update,
                             **engine_options)
    from asyncrl.rollout.hf import HFGenerateBackend
    from asyncrl.runtime.weight_sync import clone_for_rollout

    return HFGenerateBackend(clone_for_rollout(model).to(device), tokenizer, version)


def redirect_output(path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2, so native code's too) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
