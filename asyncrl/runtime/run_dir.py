"""The run directory: ``runs/<time>-<job>-<name>`` (job: train, sft, eval, dpo) with the
resolved config and all outputs.

Invariants:
  * a new run directory is created atomically (``mkdir`` without ``exist_ok``, retried with a
    suffix), so two runs started in the same second never share one;
  * while a job runs, its directory is locked (``flock`` on ``<run_dir>/.lock``, released by
    the OS if the process dies, even by SIGKILL): a second writer gets a :class:`RunDirError`
    naming the holder's pid instead of interleaving its metrics with the first's;
  * :func:`discard_if_unused` removes a directory this process created when the job failed
    before it wrote anything worth keeping (no empty run dirs left behind).
"""
from __future__ import annotations

import fcntl
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from asyncrl.config import config_to_yaml
from asyncrl.errors import RunDirError
from asyncrl.metrics.console import console
from asyncrl.training.model import quiet_transformers, resolve_device

LOCK_FILE = ".lock"
# what a run that failed before its first step leaves: nothing a user needs
_SCAFFOLDING = {LOCK_FILE, "config.yaml", "error.log", "tensorboard", "metrics.jsonl", "health_events.jsonl"}


class _Held:
    """A locked run directory of this process: its lock's file descriptor and whether this
    process created the directory."""

    def __init__(self, fd: int, created: bool):
        self.fd, self.created = fd, created


_held: dict[Path, _Held] = {}


def make_run_dir(cfg, job: str = "train") -> Path:
    """``logging.run_dir`` (created if missing), else a new ``<output_dir>/<time>-<job>-<name>``
    (the job named, so an eval of a recipe is not mistaken for its training run); locked for
    this process, with the resolved config written into it."""
    if cfg.logging.run_dir:
        path, created = _ensure_dir(Path(cfg.logging.run_dir))
    else:
        stamp = time.strftime('%Y%m%d-%H%M%S')
        path, created = _new_dir(Path(cfg.logging.output_dir), f"{stamp}-{job}-{cfg.name}")
    lock_run_dir(path, created)
    try:
        (path / "config.yaml").write_text(config_to_yaml(cfg))
    except OSError as err:
        raise RunDirError(f"cannot write to run directory {path}: {err.strerror or err}") from err
    return path


def _ensure_dir(path: Path) -> tuple[Path, bool]:
    existed = path.is_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create run directory {path}: {err.strerror or err}") from err
    return path, not existed


def _new_dir(parent: Path, name: str) -> tuple[Path, bool]:
    """``parent/name``, or ``name-1``, ``name-2`` ... : the first ``mkdir`` that succeeds wins."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create the runs directory {parent}: {err.strerror or err}") from err
    for suffix in range(10_000):
        path = parent / (name if suffix == 0 else f"{name}-{suffix}")
        try:
            path.mkdir()
            return path, True
        except FileExistsError:
            continue
        except OSError as err:
            raise RunDirError(f"cannot create run directory {path}: {err.strerror or err}") from err
    raise RunDirError(f"no free run directory name {name}-N under {parent}")


def lock_run_dir(path: Path, created: bool = False) -> None:
    """Take the run directory's lock for this process (re-entrant within it)."""
    key = Path(path).resolve()
    if key in _held:
        return
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise RunDirError(f"cannot write to run directory {path}: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"run directory {path} is in use by another run (pid {holder}); wait for it to "
                          "finish or set logging.run_dir to another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[key] = _Held(fd, created)


def release_run_dir(path: Path) -> None:
    """Release this process's lock on ``path`` (a later job of the same process may take it)."""
    held = _held.pop(Path(path).resolve(), None)
    if held is not None:
        os.close(held.fd)


def discard_if_unused(path: Path) -> bool:
    """Remove ``path`` if this process created it and it holds only scaffolding (a config, an
    empty metrics file, the lock): a job that failed before its first step. Releases the lock.
    Returns True when removed."""
    key = Path(path).resolve()
    held = _held.get(key)
    release_run_dir(path)
    if held is None or not held.created or not key.is_dir():
        return False
    names = {p.name for p in key.iterdir()}
    metrics = key / "metrics.jsonl"
    if names - _SCAFFOLDING or (metrics.is_file() and metrics.stat().st_size > 0):
        return False
    shutil.rmtree(key, ignore_errors=True)
    return True


def releasing_run_dirs(job):
    """Decorator for a job (sft, dpo, eval): the run directories it locked are released when it
    returns or fails, so a later job of the same process or another process may use them."""
    @functools.wraps(job)
    def run(*args, **kwargs):
        before = set(_held)
        try:
            return job(*args, **kwargs)
        finally:
            for key in set(_held) - before:
                release_run_dir(key)
    return run


def start_run(cfg, header: str, job: str = "train") -> tuple[torch.device, Path]:
    """What every job (train, sft, dpo) does first: torch threads and seed from the config,
    the device, the run directory; prints ``header -> run_dir``. Returns (device, run_dir)."""
    quiet_transformers()
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.seed)
    run_dir = make_run_dir(cfg, job)
    console.print(f"{header} -> {run_dir}")
    return resolve_device(cfg.trainer.device), run_dir


def run_dir_is_held(path: Path) -> Optional[bool]:
    """Whether this process holds ``path``'s lock (for tests and the failure handler)."""
    return Path(path).resolve() in _held
