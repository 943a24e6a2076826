"""Atomic checkpoints: HF safetensors model + tokenizer, optimizer state, trainer state.

A checkpoint is written into a temporary sibling directory, fsynced, then renamed into
place with one ``os.replace``; the ``latest`` pointer is replaced the same way. A crash
mid-write therefore leaves the previous checkpoint (and pointer) intact.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def write_atomic_text(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically (temp file in the same dir + os.replace)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer=None, scheduler=None,
                    state: dict | None = None, keep: int = 2, extra=None) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` atomically and return its path. ``extra(dir)``
    writes more files into the checkpoint before it is moved into place (a merged LoRA model).
    A PEFT model saves its adapter only (adapter_config.json + adapter_model.safetensors:
    ``PeftModel.from_pretrained(base, path)`` loads it)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step_{step:06d}-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if extra is not None:
            extra(tmp)
        if optimizer is not None:
            torch.save({"optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict() if scheduler is not None else None},
                       tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=2))
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step: move the old one aside first
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic_text(root / "latest", final.name)
    _prune(root, keep)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
