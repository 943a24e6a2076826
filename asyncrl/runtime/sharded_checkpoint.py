"""Step checkpoints of an FSDP2-sharded actor, with the same layout and atomicity as the
one-process ones (training/checkpoint.py), plus the shards to resume from:

    checkpoints/step_000100/
      model.safetensors, config.json, tokenizer files   the full policy (HF, compute dtype):
                                                        what `asyncrl eval` / from_pretrained load
      trainer_state.json                                step, policy version, data position ...
      dcp/                                              model + optimizer + scheduler shards (fp32
                                                        master), resumable at any world size
      adapter_config.json, adapter_model.safetensors    instead of model.safetensors for a LoRA
                                                        policy (PEFT's format; its dcp/ holds the
                                                        adapters and their optimizer state only)
      merged/                                           with actor.lora.save_merged
      rng/rank_<r>.pt                                   each rank's RNG state

Rank 0 creates the temporary directory, every rank writes its shards into it (a shared file
system across nodes, as DCP assumes), and rank 0 renames it into place only after all ranks
finished: a crash at any point leaves the previous checkpoint and ``latest`` intact.
"""
from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.distributed import checkpoint as sharded
from asyncrl.distributed.lockstep import replicated
from asyncrl.training import lora_sharded
from asyncrl.training.checkpoint import write_checkpoint
from asyncrl.training.lora import is_lora


class ShardedCheckpointer:
    """Writes (and reloads) the actor's sharded state; ``tokenizer`` only on rank 0."""

    def __init__(self, actor, tokenizer, dtype: torch.dtype, save_merged: bool = False):
        """``save_merged`` (``actor.lora.save_merged``): a LoRA checkpoint also holds ``merged/``."""
        self.actor, self.tokenizer, self.dtype, self.dp = actor, tokenizer, dtype, actor.dp
        self.save_merged = save_merged

    def save(self, run_dir: Path, step: int, state: dict, keep: int) -> Path:
        """Rank 0 (the job): write ``<run_dir>/checkpoints/step_<step>`` by training/checkpoint.py's
        protocol (temp dir, manifest, one rename, ``latest``); returns it."""
        return write_checkpoint(run_dir, step, self._write_all, state, keep)

    def _write_all(self, directory: Path) -> None:
        self.write(str(directory))
        self.tokenizer.save_pretrained(str(directory))

    @replicated("checkpoint")
    def write(self, directory: str) -> None:
        """Every rank: shards, RNG, and its part of the HF export's gathers; returns when all
        ranks are done (the directory is then complete)."""
        actor, path = self.actor, Path(directory)
        sharded.save(path, actor.forward_module, actor.optimizer, actor.scheduler, self.dp)
        if is_lora(actor.model):  # PEFT's adapter files, as one process writes them (HFPolicyState)
            lora_sharded.save_adapter(actor.model, path, self.dp)
            if self.save_merged:
                lora_sharded.save_merged(actor.forward_module, actor.model, path / "merged", self.dp, self.dtype)
        else:
            sharded.export_hf(path, actor.forward_module, actor.model, self.dp, self.dtype)
        self.dp.barrier()

    @replicated("checkpoint")
    def load(self, step_dir: str) -> None:
        """Every rank: the actor's model, optimizer and scheduler from ``step_dir`` (any world size)."""
        actor = self.actor
        sharded.load(Path(step_dir), actor.forward_module, actor.optimizer, actor.scheduler, self.dp)


class ShardedPolicyState:
    """:class:`~asyncrl.training.checkpoint.HFPolicyState`'s two methods for a sharded actor, so
    that issue 18's checkpoints and ``trainer.resume`` (runtime/resume.py: manifest, ``latest``,
    ``resume.pt``) carry the DCP shards: ``write`` runs on every rank (the HF export, the shards
    and each rank's RNG), ``load`` restores the actor's model, optimizer and scheduler at any
    world size. The critic is not in it (a sharded resume with a critic is refused, pipeline.py)."""

    def __init__(self, checkpointer: ShardedCheckpointer):
        self.checkpointer = checkpointer

    def write(self, directory: Path) -> None:
        self.checkpointer.write(str(directory))
        self.checkpointer.tokenizer.save_pretrained(str(directory))

    def load(self, directory: Path) -> None:
        self.checkpointer.load(str(directory))
