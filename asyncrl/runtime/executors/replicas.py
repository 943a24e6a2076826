"""Start a fleet of engine replicas as processes on this host (``rollout.engines`` replicas of
``rollout.tensor_parallel_size`` ranks each; ``rollout/fleet.py`` routes and syncs them).

    replica i: a RolloutProcess on cuda:first + i·tp (its engine spawns TP ranks on the next
               tp − 1 GPUs), or on the CPU; its output goes to <log_dir>/replica<i>.log
    weights:   one TrainerWeights for all: shared tensors every replica reads, or one broadcast
               group (trainer = rank 0, replica i = rank 1 + i)

Everything that can be checked is checked before any process starts: the TP size against the
model's heads, and replicas × TP against the visible GPUs. A replica that does not become ready
within ``start_timeout_s`` is named with its log; the others are stopped.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from asyncrl.rollout.fleet import Fleet
from asyncrl.runtime.executors.process import RolloutProcess, TrainerWeights
from asyncrl.runtime.waits import DEFAULT_HANG_TIMEOUT_S


class FleetConfigError(ValueError):
    """A fleet that cannot be placed on this machine (found before anything starts)."""


def fleet_devices(rollout_device: str, engines: int, tensor_parallel_size: int,
                  visible: Optional[int] = None) -> list[str]:
    """Each replica's device (its TP rank 0): ``cuda:first + i·tp``, or the CPU. Raises
    :class:`FleetConfigError` when replicas × TP GPUs from ``first`` are more than visible."""
    device = torch.device(rollout_device)
    if device.type != "cuda":
        return [str(device)] * engines
    first, need = device.index or 0, engines * tensor_parallel_size
    visible = torch.cuda.device_count() if visible is None else visible
    if first + need > visible:
        raise FleetConfigError(
            f"rollout.engines={engines} x rollout.tensor_parallel_size={tensor_parallel_size} needs {need} GPU(s) "
            f"(cuda:{first}..cuda:{first + need - 1}), but {visible} are visible from {rollout_device}: lower "
            "rollout.engines or rollout.tensor_parallel_size, or set runtime.rollout_device")
    return [f"cuda:{first + i * tensor_parallel_size}" for i in range(engines)]


def check_model_splits(model: torch.nn.Module, tensor_parallel_size: int) -> None:
    """The trainer's HF model splits over ``tensor_parallel_size`` ranks (named error otherwise)."""
    from asyncrl.engine.models.config import ModelConfig
    from asyncrl.engine.parallel import check_tensor_parallel

    check_tensor_parallel(ModelConfig.from_dict(model.config.to_dict(), architecture=type(model).__name__),
                          tensor_parallel_size)


def check_fleet_splits(model: torch.nn.Module, backend_name: str, tensor_parallel_size: int) -> None:
    """TP > 1 needs the asyncrl engine and a model whose heads split over the ranks (named errors)."""
    tp = tensor_parallel_size
    if tp > 1:
        if backend_name != "engine":
            raise FleetConfigError(f"rollout.tensor_parallel_size={tp} needs the asyncrl engine "
                                   f"(rollout.backend=engine), not {backend_name!r}")
        check_model_splits(model, tp)


def replica_engine_options(engine_options: Optional[dict], tensor_parallel_size: int, backend_name: str,
                           index: int) -> dict:
    """Replica ``index``'s backend options: its TP size and, for the engine, its own seed
    (requests without a seed draw one from their engine's RNG: a different stream per replica)."""
    options = {**(engine_options or {}),
               **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {})}
    return {**options, "seed": options.get("seed", 0) + index} if backend_name == "engine" else options


def start_fleet(model: torch.nn.Module, tokenizer, backend_name: str, *, engines: int, tensor_parallel_size: int,
                rollout_device: str, transport: str = "shared", kv_on_update: str = "keep",
                dtype: Optional[torch.dtype] = None, engine_options: Optional[dict] = None,
                log_dir: Optional[Path] = None, start_timeout_s: float = 300.0,
                on_lost: Optional[Callable[[str], None]] = None, max_restarts: int = 0,
                hang_timeout_s: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
                on_restart: Optional[Callable[[int, str], None]] = None) -> Fleet:
    """Spawn the replicas (all at once), connect the weights, wait until every one is ready.
    Each replica restarts up to ``max_restarts`` times (shared weights; a collective group of
    several replicas cannot take a new member) and no wait on one outlasts ``hang_timeout_s``;
    ``on_restart(restarts, reason)`` hears of each restart, with the replica named in ``reason``."""
    tp = tensor_parallel_size
    check_fleet_splits(model, backend_name, tp)
    devices = fleet_devices(rollout_device, engines, tp)
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="asyncrl-rollout-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    weights = TrainerWeights(model, transport, devices[0], members=engines, hang_timeout_s=hang_timeout_s,
                             max_restarts=max_restarts)
    replicas: list[RolloutProcess] = []
    try:
        for i, device in enumerate(devices):
            # a replica with TP ranks spawns them itself, which a daemonic process may not
            own = replica_engine_options(engine_options, tp, backend_name, i)
            replicas.append(RolloutProcess(weights, tokenizer, backend_name, 0, kv_on_update, dtype, own, device,
                                           rank=1 + i, name=f"rollout replica {i}",
                                           log_path=str(log_dir / f"replica{i}.log"), daemon=tp == 1,
                                           max_restarts=max_restarts, hang_timeout_s=hang_timeout_s,
                                           on_restart=named_restarts(on_restart, f"rollout replica {i}"),
                                           start_timeout_s=start_timeout_s))
        deadline = time.monotonic() + start_timeout_s
        for replica in replicas:
            replica.wait_joining(max(deadline - time.monotonic(), 1.0))
        weights.connect(0)
        for replica in replicas:
            replica.wait_ready(max(deadline - time.monotonic(), 1.0))
    except BaseException:
        for replica in replicas:
            replica.close(timeout=10.0)
        weights.close()
        raise
    return Fleet(replicas, weights, on_lost=on_lost, can_lose_replicas=transport == "shared")


def named_restarts(on_restart: Optional[Callable[[int, str], None]],
                   name: str) -> Optional[Callable[[int, str], None]]:
    """``on_restart`` with the replica's name before the reason."""
    if on_restart is None:
        return None
    return lambda restarts, reason: on_restart(restarts, f"{name}: {reason}")
