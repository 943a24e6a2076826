"""Resume a training run exactly where a checkpoint left it (``trainer.resume``).

``trainer.resume``: ``never`` (the default: start at step 1; a run directory that already
holds a run is refused rather than overwritten), ``auto`` (the latest complete checkpoint of
``logging.run_dir``, or, when that is unset, of the newest run directory of this run's name
under ``logging.output_dir``; none: start at step 1), or the path of a checkpoint or run dir.
The run continues in the checkpoint's run directory.

What a checkpoint restores, and who owns each piece:

  weights, optimizer (with master weights), lr scheduler      checkpoint.HFPolicyState
  policy version, KL controller, critic, stage-time totals,   controller.state_dict()
  data position, async rollout round (the engine's seeds)
  RNG streams: torch (CPU and CUDA), numpy, python            :func:`rng_state`
  health monitors, stage profile, pre-RL eval, run totals     the pipeline's run state
  step counter                                                trainer_state.json

The engine's sampling needs no state of its own: every request carries its seed, a function
of (seed, step, round) in sync mode and of (seed, rollout round) in async mode.

Metrics continue in the same ``metrics.jsonl`` and TensorBoard directory: rows of steps after
the checkpoint (written before the crash) are removed first (:func:`truncate_logs`,
TensorBoard's ``purge_step``), so every step appears exactly once.

Async mode: groups generated but not yet trained when the checkpoint is written are
**regenerated**, not saved. Proof that none is trained twice and none is lost: group ids
follow the prompt stream (group g is prompt ``start + g``, both handed out under one lock),
and the trainer takes groups strictly in id order, skipping only released (timed-out) ones
(buffer.py). So after a step, ids below the buffer's cursor were all trained or released and
none above it was. The checkpoint stores ``start + cursor`` as the data position; the resumed
run's stream starts there, so each untrained prompt is generated again (with the resumed
weights) and each trained one never comes back.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from asyncrl.errors import CheckpointError, RunDirError
from asyncrl.training.checkpoint import is_complete, latest_checkpoint, write_atomic_text

RESUME_FILE = "resume.pt"


# ---- which checkpoint ---------------------------------------------------------------------

def find_resume_checkpoint(cfg) -> Optional[Path]:
    """The checkpoint ``trainer.resume`` asks for, or None to start at step 1."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        if cfg.logging.run_dir:
            return latest_checkpoint(Path(cfg.logging.run_dir))
        run = newest_run_named(Path(cfg.logging.output_dir), cfg.name)
        return latest_checkpoint(run) if run is not None else None
    path = Path(mode).expanduser()
    if is_complete(path):
        return path
    found = latest_checkpoint(path) or latest_checkpoint(path.parent)  # a run dir or its checkpoints/
    if found is None:
        raise CheckpointError(f"trainer.resume={mode}: neither a complete checkpoint nor a run directory holding "
                              "one (use auto, never, or a path)")
    return found


def newest_run_named(output_dir: Path, name: str) -> Optional[Path]:
    """The newest ``<time>-[<job>-]<name>[-N]`` run directory with a complete checkpoint."""
    pattern = re.compile(rf"^\d{{8}}-\d{{6}}-(?:train-)?{re.escape(name)}(?:-\d+)?$")
    runs = sorted((p for p in output_dir.glob(f"*{name}*") if p.is_dir() and pattern.match(p.name)),
                  key=lambda p: p.name)
    for run in reversed(runs):
        if latest_checkpoint(run) is not None:
            return run
    return None


def run_dir_of(checkpoint: Path) -> Path:
    """``<run_dir>/checkpoints/step_N`` -> ``<run_dir>``."""
    return Path(checkpoint).parent.parent


def config_for_resume(cfg, checkpoint: Optional[Path]):
    """``cfg`` with ``logging.run_dir`` set to the checkpoint's run (unless one is given)."""
    if checkpoint is None or cfg.logging.run_dir:
        return cfg
    logging = dataclasses.replace(cfg.logging, run_dir=str(run_dir_of(checkpoint)))
    return dataclasses.replace(cfg, logging=logging)


def refuse_to_overwrite(run_dir: Path) -> None:
    """``trainer.resume=never`` into a directory that holds a run: a named error, not silent
    duplicate step rows and overwritten checkpoints."""
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    has_rows = metrics.is_file() and metrics.stat().st_size > 0
    has_checkpoints = checkpoints.is_dir() and any(checkpoints.glob("step_*"))
    if has_rows or has_checkpoints:
        raise RunDirError(f"run directory {run_dir} already holds a run: continue it with trainer.resume=auto, "
                          "or set logging.run_dir to a new directory")


# ---- the data position --------------------------------------------------------------------

class CountingStream:
    """The prompt stream, counting what it hands out.

    ``start`` examples are skipped first (a resumed run's data position); ``position`` is
    start + examples handed out since. Only the controller's rollout side calls ``next``."""

    def __init__(self, stream: Iterator, start: int = 0):
        self._stream = iter(stream)
        for _ in range(start):  # task streams are generators: replaying is the only seek
            next(self._stream)
        self.start = self.position = start

    def __iter__(self) -> "CountingStream":
        return self

    def __next__(self):
        example = next(self._stream)
        self.position += 1
        return example


# ---- RNG streams ---------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- objects whose attributes are their state -----------------------------------------------

def attributes(obj, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A monitor's or profile's state: its attributes (pickled by torch.save), minus ``skip``."""
    return {k: v for k, v in vars(obj).items() if k not in skip}


def restore_attributes(obj, state: dict[str, Any]) -> None:
    """Put :func:`attributes` back; parts holding a ``cfg`` (health monitors) get ``obj``'s
    current one (a resumed run may change thresholds)."""
    vars(obj).update(state)
    for part in getattr(obj, "monitors", ()):
        if hasattr(obj, "cfg") and hasattr(part, "cfg"):
            part.cfg = obj.cfg


# ---- files -------------------------------------------------------------------------------

def write_resume_state(directory: Path, state: dict[str, Any]) -> None:
    torch.save(state, Path(directory) / RESUME_FILE)


def read_resume_state(checkpoint: Path) -> dict[str, Any]:
    file = Path(checkpoint) / RESUME_FILE
    if not file.is_file():
        raise CheckpointError(f"{checkpoint} has no {RESUME_FILE} (written before resume existed): it can be "
                              "evaluated or used as model.path, not resumed")
    return torch.load(file, map_location="cpu", weights_only=False)


def truncate_logs(run_dir: Path, step: int) -> None:
    """Drop rows of steps after ``step`` from metrics.jsonl, health_events.jsonl and
    samples.jsonl (written after the checkpoint, before the run stopped): the resumed run
    writes them again."""
    for name in ("metrics.jsonl", "health_events.jsonl", "samples.jsonl"):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = [line for line in path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
        write_atomic_text(path, "".join(kept))


def _row_step(line: str) -> float:
    try:
        row = json.loads(line)
    except ValueError:
        return float("inf")  # a line cut by the crash: dropped
    return row.get("step", 0) if isinstance(row, dict) else 0


# ---- the pipeline's side: one object writes and restores a run's checkpoints ---------------

class RunCheckpoints:
    """Checkpoints of one training run: the policy through ``policy_state`` (an
    :class:`~asyncrl.training.checkpoint.HFPolicyState`, or a sharded trainer's writer with the
    same ``write``/``load``), everything else through ``resume.pt``.

    ``run_state()`` (the pipeline's: health, profile, pre-RL eval, totals) is saved with every
    checkpoint and handed back by :meth:`restore`."""

    def __init__(self, cfg, run_dir: Path, controller, policy_state, source):
        self.cfg, self.run_dir, self.controller = cfg, Path(run_dir), controller
        self.policy_state, self.source = policy_state, source

    def save(self, step: int, run_state: dict) -> Path:
        from asyncrl.training.checkpoint import write_checkpoint

        controller = self.controller.state_dict()
        resume = {"controller": controller, "rng": rng_state(), "run": run_state}

        def write(directory: Path) -> None:
            self.policy_state.write(directory)
            write_resume_state(directory, resume)

        info = {"policy_version": controller["version"], "seed": self.cfg.seed,
                "data": {"prompts_consumed": controller["prompts"], **self.source.state_dict()}}
        return write_checkpoint(self.run_dir, step, write, info, keep=self.cfg.trainer.keep_checkpoints)

    def restore(self, point: "ResumePoint") -> None:
        """Load ``point`` into the policy, the controller and the RNG streams, and drop the
        metrics rows of steps after it."""
        self.policy_state.load(point.checkpoint)
        self.controller.load_state_dict(point.state["controller"])
        set_rng_state(point.state["rng"])
        truncate_logs(self.run_dir, point.step)


class ResumePoint:
    """A checkpoint to resume from, read before anything is built: the prompt stream must
    start at its data position (``prompts``) before the controller takes it."""

    def __init__(self, checkpoint: Path):
        from asyncrl.training.checkpoint import read_state

        self.checkpoint = Path(checkpoint)
        self.state = read_resume_state(self.checkpoint)
        self.step = int(read_state(self.checkpoint)["step"])

    @property
    def prompts(self) -> int:
        return int(self.state["controller"]["prompts"])

    @property
    def run(self) -> dict:
        """The pipeline's run state saved with the checkpoint."""
        return self.state["run"]
