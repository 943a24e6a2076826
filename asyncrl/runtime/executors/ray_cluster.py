"""The Ray cluster a rollout fleet runs on (``runtime.executor=ray``): join it or start a local
one, and check before any model loads that it can hold the replicas (named errors, not a
placement that waits forever). The replicas themselves: ``ray_replicas.py``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from asyncrl.runtime.executors.replicas import FleetConfigError


def init_ray(num_cpus: Optional[int] = None, reserve_gpu: Optional[int] = None) -> None:
    """Join the cluster at ``RAY_ADDRESS``, or start a local Ray with ``num_cpus``; a local Ray
    is not shown GPU ``reserve_gpu`` (the trainer's, in this process), so no replica lands on it."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if reserve_gpu is not None and torch.cuda.is_available():
        visible = saved.split(",") if saved else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(d for i, d in enumerate(visible) if i != reserve_gpu)
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def replicas_on_gpu(cfg) -> bool:
    """The replica actors take GPUs: ``runtime.rollout_device`` (cuda | cpu), else the trainer's device."""
    device = cfg.runtime.rollout_device or cfg.trainer.device
    return torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"


def init_ray_for(cfg) -> None:
    """:func:`init_ray` for a run: ``runtime.ray_num_cpus`` CPUs (null: this machine's cores,
    but at least one per rollout actor plus one for the reward actors: Ray's CPUs are scheduling
    units, and 2 replicas on a 2-core laptop should start); the trainer's GPU kept from Ray."""
    device = cfg.trainer.device
    on_gpu = torch.cuda.is_available() if device == "auto" else torch.device(device).type == "cuda"
    trainer_gpu = (torch.device(device).index or 0) if on_gpu and device != "auto" else (0 if on_gpu else None)
    actors = cfg.rollout.engines + 1
    init_ray(cfg.runtime.ray_num_cpus or max(os.cpu_count() or 1, actors), reserve_gpu=trainer_gpu)


def check_cluster_cpus(engines: int) -> None:
    """One CPU per replica actor exists in the Ray cluster (named error, not a placement wait)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    if engines > total:
        raise FleetConfigError(f"rollout.engines={engines} replica actors need {engines} CPU(s) (one each), but the "
                               f"Ray cluster has {total:g}: raise runtime.ray_num_cpus or lower rollout.engines")


def check_cluster_gpus(engines: int, tensor_parallel_size: int) -> None:
    """Replicas x TP GPUs are in the Ray cluster, and TP of them on one node (named error)."""
    import ray

    need, tp = engines * tensor_parallel_size, tensor_parallel_size
    total = int(ray.cluster_resources().get("GPU", 0))
    if need > total:
        raise FleetConfigError(
            f"rollout.engines={engines} x rollout.tensor_parallel_size={tp} needs {need} GPU(s), but the Ray "
            f"cluster has {total}: lower rollout.engines or rollout.tensor_parallel_size, or add nodes")
    largest = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]), default=0)
    if tp > largest:
        raise FleetConfigError(f"rollout.tensor_parallel_size={tp} needs {tp} GPUs on one node (a replica's ranks "
                               f"share a node), but the largest node of the Ray cluster has {largest}")
