"""Sharded checkpoints of a role with ``torch.distributed.checkpoint`` (DCP), and the full HF
export of its policy.

    save(step_dir, module, optimizer, scheduler, dp)   every rank writes its own shards into
        step_dir/dcp (model, optimizer and scheduler state; FQN-keyed, so resumable at any
        world size: DCP reshards on load) and its RNG state into step_dir/rng/rank_<r>.pt;
        frozen parameters (a LoRA base) are not written (they come from model.path)
    load(step_dir, module, optimizer, scheduler, dp)   the inverse, at this run's world size;
        a checkpoint of another model shape fails before anything is loaded, naming the
        first tensor that differs
    export_hf(step_dir, module, hf_model, dp, dtype)   model.safetensors (+ config) that
        ``AutoModelForCausalLM.from_pretrained`` loads: gathered tensor by tensor to rank 0's
        host memory (``full_state_dict + cpu_offload``), never the whole model on one GPU

The step directory itself (a temporary folder renamed into place once complete) belongs to
the caller: every function here is a collective writing into a directory that already exists.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from asyncrl.distributed.group import DataParallel

DCP_DIR = "dcp"
RNG_DIR = "rng"


class CheckpointMismatch(ValueError):
    """A checkpoint whose tensors do not fit the model being resumed."""


def _options(module: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (a LoRA model's base) are left out: no step changes them, a resume
    loads them from ``model.path`` as the first run did (as one process resumes LoRA), and a
    checkpoint holds the trained tensors and their optimizer state only (MBs, not the base)."""
    frozen = any(not p.requires_grad for p in module.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _app_state(module, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_options(module))
    return {"model": model_sd, "optimizer": optim_sd}


def save(step_dir: Path, module: torch.nn.Module, optimizer, scheduler, dp: DataParallel) -> None:
    """Write ``module`` / ``optimizer`` shards, the scheduler and this rank's RNG (collective)."""
    state = {**_app_state(module, optimizer), "scheduler": scheduler.state_dict() if scheduler is not None else {}}
    dcp.save(state, checkpoint_id=str(Path(step_dir) / DCP_DIR))
    rng_dir = Path(step_dir) / RNG_DIR
    rng_dir.mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(rng, rng_dir / f"rank_{dp.rank}.pt")


def load(step_dir: Path, module: torch.nn.Module, optimizer, scheduler, dp: DataParallel) -> None:
    """Load a :func:`save` checkpoint into ``module`` / ``optimizer`` / ``scheduler`` at this
    world size (collective). RNG: this rank's file, else rank 0's (another world size)."""
    path = Path(step_dir) / DCP_DIR
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{step_dir}: no sharded checkpoint ({path}/.metadata missing)")
    state = _app_state(module, optimizer)
    check_shapes(path, state["model"])
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else {}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(module))
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    _load_rng(Path(step_dir) / RNG_DIR, dp.rank)


def check_shapes(dcp_path: Path, model_state: dict) -> None:
    """Raise :class:`CheckpointMismatch` naming the first model tensor that the checkpoint
    lacks or holds with another shape (DCP would otherwise hang or fail deep inside)."""
    saved = dcp.FileSystemReader(str(dcp_path)).read_metadata().state_dict_metadata
    lora_saved = any(".lora_" in k for k in saved)
    for name, tensor in model_state.items():
        key = f"model.{name}"
        if key not in saved:
            cause = ("a LoRA checkpoint resumes with the same actor.lora settings only"
                     if lora_saved or ".lora_" in name else "another architecture or depth?")
            raise CheckpointMismatch(f"checkpoint {dcp_path.parent} does not fit this model: tensor {name!r} "
                                     f"{list(tensor.shape)} is not in it ({cause})")
        size = list(getattr(saved[key], "size", []))
        if size != list(tensor.shape):
            raise CheckpointMismatch(f"checkpoint {dcp_path.parent} does not fit this model: first mismatching "
                                     f"tensor {name!r} is {size} in the checkpoint and {list(tensor.shape)} in the "
                                     "model (another model size?)")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in model_state)
    if extra:
        raise CheckpointMismatch(f"checkpoint {dcp_path.parent} does not fit this model: tensor {extra[0]!r} is in "
                                 "the checkpoint but not in the model (another architecture or depth?)")


def _load_rng(rng_dir: Path, rank: int) -> None:
    path = rng_dir / f"rank_{rank}.pt"
    path = path if path.is_file() else rng_dir / "rank_0.pt"
    if not path.is_file():
        return
    rng = torch.load(path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


def export_hf(step_dir: Path, module: torch.nn.Module, hf_model, dp: DataParallel, dtype: torch.dtype,
              prefix: str = "policy.") -> Optional[Path]:
    """Rank 0 writes ``hf_model``'s full weights (gathered from ``module``'s shards, names
    without ``prefix``, cast to ``dtype``) with ``save_pretrained`` into ``step_dir``; every
    rank takes part in the gathers. Returns the directory on rank 0, None elsewhere."""
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dp.is_main:
        return None
    state = {(k[len(prefix):] if k.startswith(prefix) else k): v.to(dtype) if v.is_floating_point() else v
             for k, v in full.items()}
    hf_model.save_pretrained(str(step_dir), state_dict=state, safe_serialization=True)
    return Path(step_dir)
