"""Checkpoints that are never lost: HF safetensors model + tokenizer, optimizer state, the
state an exact resume needs, and a manifest.

Layout::

    <run_dir>/checkpoints/step_000040/   config.json, model.safetensors, tokenizer files,
                                         optimizer.pt, resume.pt, trainer_state.json
    <run_dir>/checkpoints/latest         the name of the newest complete step directory

Invariant: at every instant (a SIGKILL may land anywhere) some complete checkpoint is
published and ``latest_checkpoint`` returns one — never a partial directory — as long as one
was ever completed. How:

  1. everything is written into ``.tmp-step_N-*`` and fsynced; ``trainer_state.json`` comes
     last and lists every file with its size (the manifest: :func:`is_complete` checks it);
  2. publishing is one ``os.replace`` of the temp dir onto ``step_N``. A step saved a second
     time by the same run (the end-of-run save after a periodic one) is skipped: its content
     is the same. A ``step_N`` of another run (a resume from an older step) is first renamed
     to ``.old-step_N-*``, which :func:`latest_checkpoint` still accepts until the new one is
     in, and deleted after;
  3. ``latest`` is replaced atomically after publishing; pruning never deletes the checkpoint
     ``latest`` names; a ``latest`` naming a missing or incomplete directory falls back to the
     newest complete step;
  4. leftovers of an interrupted save (``.tmp-*``, ``.old-*``) are cleaned by the next save.

The model and optimizer go through one writer (``write(directory)``): :class:`HFPolicyState`
here; a sharded (DCP) trainer plugs its own writer into :func:`write_checkpoint` and keeps the
protocol, the manifest and ``latest``.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from asyncrl.errors import CheckpointError

STATE_FILE = "trainer_state.json"  # written last: the manifest
OPTIMIZER_FILE = "optimizer.pt"
SESSION = uuid.uuid4().hex  # this process: a step it saved twice has the same content
_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: mkdtemp/mkstemp create 0700/0600, we want what the user's umask gives


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX: fsync the directory itself)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory; the rename stays atomic
        pass
    finally:
        os.close(fd)


def _share_like_umask(path: Path) -> None:
    """Give a temp dir/file the permissions a plain mkdir/open would (teammates can read runs)."""
    mode = (0o777 if path.is_dir() else 0o666) & ~_UMASK
    os.chmod(path, mode)


def write_atomic_text(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically (temp file in the same dir + os.replace)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _share_like_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- completeness and the latest pointer --------------------------------------------------

def read_state(path: Path) -> Optional[dict]:
    """The checkpoint's ``trainer_state.json``, or None when absent or unreadable."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def is_complete(path: Path) -> bool:
    """True when every file the manifest lists is there with its size (a checkpoint written
    before manifests existed: its state file and a safetensors file)."""
    path = Path(path)
    state = read_state(path) if path.is_dir() else None
    if state is None or "step" not in state:
        return False
    files = state.get("files")
    if files is None:
        return any(path.glob("*.safetensors"))
    for name, size in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return False
    return True


def _step_dirs(root: Path) -> list[Path]:
    """Published step directories, oldest first (``.old-step_*`` included, see the module doc)."""
    dirs = [p for p in root.glob("step_*") if p.is_dir()]
    dirs += [p for p in root.glob(".old-step_*") if p.is_dir()]
    return sorted(dirs, key=lambda p: (_step_of(p), p.name.startswith("step_")))


def _step_of(path: Path) -> int:
    digits = path.name.split("step_", 1)[1][:6]
    return int(digits) if digits.isdigit() else -1


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint of ``run_dir``, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return [p for p in _step_dirs(root) if is_complete(p)] if root.is_dir() else []


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one, else None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


# ---- writing ------------------------------------------------------------------------------

def write_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], state: Optional[dict] = None,
                     keep: int = 2) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step>`` by the protocol of the module doc and return it.

    ``write(directory)`` fills the temp directory (model, optimizer, anything); ``state`` goes
    into ``trainer_state.json`` with the step and the manifest. Raises :class:`CheckpointError`
    naming the cause (e.g. no space left) with the previous checkpoint intact."""
    root = Path(run_dir) / "checkpoints"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create {root}: {err.strerror or err}") from err
    clean_leftovers(root)
    final = root / f"step_{step:06d}"
    if is_complete(final) and (read_state(final) or {}).get("session") == SESSION:
        _point_latest(root, final)  # saved already by this run: same weights, same state
        return final
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step_{step:06d}-"))
    try:
        _share_like_umask(tmp)
        write(tmp)
        _write_manifest(tmp, step, state or {})
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception) and not isinstance(err, CheckpointError):
            raise CheckpointError(_failure_message(root, step, err)) from err
        raise
    _point_latest(root, final)
    _prune(root, keep)
    return final


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer=None, scheduler=None,
                    state: Optional[dict] = None, keep: int = 2,
                    extra: Optional[Callable[[Path], None]] = None) -> Path:
    """:func:`write_checkpoint` of an :class:`HFPolicyState` (the single-process trainer's);
    ``extra(dir)`` writes more files into it before it is published (a merged LoRA model)."""
    return write_checkpoint(run_dir, step, HFPolicyState(model, tokenizer, optimizer, scheduler, extra).write,
                            state, keep)


def _write_manifest(directory: Path, step: int, state: dict) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}
    body = {"step": step, **state, "session": SESSION, "files": files}
    (directory / STATE_FILE).write_text(json.dumps(body, indent=2))


def _publish(tmp: Path, final: Path) -> None:
    """Move ``tmp`` onto ``final``; an existing ``final`` is kept aside until the new one is in."""
    aside = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _point_latest(root: Path, final: Path) -> None:
    write_atomic_text(root / "latest", final.name)


def clean_leftovers(root: Path) -> None:
    """Delete interrupted saves (``.tmp-*``); put a set-aside ``.old-step_N`` back when its
    replacement never arrived, else delete it. Only one writer runs per run dir (run_dir.py's
    lock), so nothing here is in use."""
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    for old in root.glob(".old-step_*"):
        published = root / old.name[len(".old-"):].rsplit("-", 1)[0]
        if not published.exists() and is_complete(old):
            os.replace(old, published)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for stray in root.glob(".latest.*"):  # an interrupted write_atomic_text of the pointer
        stray.unlink(missing_ok=True)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (and whatever ``latest`` names)."""
    latest = latest_checkpoint(root.parent)
    steps = [p for p in _step_dirs(root) if p.name.startswith("step_")]
    complete = [p for p in steps if is_complete(p)]
    for old in complete[:-keep]:
        if old != latest:
            shutil.rmtree(old, ignore_errors=True)


def _failure_message(root: Path, step: int, err: BaseException) -> str:
    cause = _describe(err, root)
    previous = latest_checkpoint(root.parent)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return f"checkpoint of step {step} not written to {root}: {cause}; {kept}"


def _describe(err: BaseException, root: Path) -> str:
    """The cause in words. torch.save reports a full disk as ``enforce fail at
    inline_container.cc``: the free space tells it apart."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device ({_free_mib(root)} MiB free)"
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({err.filename or root})"
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "enforce fail" in text or "write" in text.lower():
        free = _free_mib(root)
        if free is not None and free < 64:
            return f"no space left on device ({free} MiB free)"
    return f"{type(err).__name__}: {text}"


def _free_mib(root: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(root).free // 2**20
    except OSError:
        return None


# ---- the policy's writer and reader --------------------------------------------------------

class HFPolicyState:
    """The policy as an HF checkpoint (``save_pretrained``: safetensors that transformers loads
    as is) + tokenizer + ``optimizer.pt`` (optimizer and scheduler ``state_dict``s; with master
    weights the optimizer's state holds them, see mixed_precision.py).

    A LoRA policy (a PEFT model) saves its adapter only, in PEFT's format (adapter_config.json +
    adapter_model.safetensors: ``PeftModel.from_pretrained(base, path)`` loads it), and its
    optimizer state covers the adapters only; ``load`` puts the adapter back into the same
    PEFT model (the base comes from ``model.path``, as in the run that saved it).
    ``extra(directory)`` writes more files before the manifest (``merged/``: the merged model).

    ``write`` is a :func:`write_checkpoint` writer; ``load`` restores the same objects in place.
    A sharded trainer replaces this class (same two methods)."""

    def __init__(self, model, tokenizer, optimizer=None, scheduler=None,
                 extra: Optional[Callable[[Path], None]] = None):
        self.model, self.tokenizer, self.optimizer, self.scheduler = model, tokenizer, optimizer, scheduler
        self.extra = extra

    def write(self, directory: Path) -> None:
        check_finite(self.model)
        self.model.save_pretrained(str(directory), safe_serialization=True)  # PEFT: the adapter only
        self.tokenizer.save_pretrained(str(directory))
        if self.extra is not None:
            self.extra(directory)
        if self.optimizer is not None:
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None},
                       directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        if _is_peft(self.model):
            load_adapter_weights(self.model, directory)
        else:
            load_model_weights(self.model, directory)
        file = Path(directory) / OPTIMIZER_FILE
        if self.optimizer is None:
            return
        if not file.is_file():
            raise CheckpointError(f"{directory}: no {OPTIMIZER_FILE}: the optimizer state cannot be restored")
        saved = torch.load(file, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None and saved.get("scheduler") is not None:
            self.scheduler.load_state_dict(saved["scheduler"])


def check_finite(model: torch.nn.Module) -> None:
    """Refuse to save NaN/Inf weights: a poisoned checkpoint must never become ``latest``."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise CheckpointError(f"refusing to save a checkpoint: parameter {name} holds NaN/Inf values")


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's names


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def load_adapter_weights(model, directory: Path) -> None:
    """Copy a LoRA checkpoint's adapter (PEFT's ``adapter_model.safetensors``) into ``model``, a
    PEFT model built with the same ``actor.lora`` settings, in place (a resume). Every adapter tensor must
    be covered; the base weights are the model's own (frozen, never saved)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS}: not a LoRA checkpoint, and a LoRA run "
                              "(actor.lora.rank > 0) resumes only a LoRA run's checkpoint (resume it with "
                              "actor.lora.rank=0)")
    try:
        tensors = load_file(str(file))
    except Exception as err:  # safetensors raises its own SafetensorError on a truncated header
        raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from err
    adapters = {n for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    try:
        result = set_peft_model_state_dict(model, tensors)
    except RuntimeError as err:  # shape mismatch: another rank or target modules
        raise CheckpointError(f"{directory}: the adapter does not fit this model (same actor.lora settings?): "
                              f"{str(err).splitlines()[0]}") from err
    missing = sorted(adapters & set(result.missing_keys))
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        names = missing or unexpected
        what = "no weights for" if missing else "tensors this model lacks:"
        raise CheckpointError(f"{directory}: the adapter does not fit this model (same actor.lora settings?): {what} "
                              f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Copy the safetensors weights of ``directory`` into ``model`` in place (exact: the same
    dtype is saved and loaded). Every parameter must be covered (a tied one through its twin)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / ADAPTER_CONFIG).is_file() and not any(directory.glob("model*.safetensors")):
        raise CheckpointError(f"{directory}: a LoRA checkpoint (PEFT adapter only): resume it with the "
                              "actor.lora settings (rank > 0, target modules) and the base model of the run that "
                              "saved it")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own SafetensorError on a truncated header
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from err
    params = dict(model.named_parameters())
    missing = {id(p) for n, p in params.items()} - {id(params[n]) for n in tensors if n in params}
    if missing:
        names = [n for n, p in params.items() if id(p) in missing]
        raise CheckpointError(f"{directory}: no weights for {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in params:
                params[name].copy_(tensor)
