"""The Ray executor: generation and rewards run in Ray actors, in their own processes.

    placement group (PACK): [{CPU: 1}] rollout actor + reward_workers × [{CPU: 1/reward_workers}]
    a fleet (rollout.engines > 1 or tensor_parallel_size > 1): replica actors in a placement
    group of their own (ray_replicas.py), the reward actors in this one

The controller code is the same as with the local executor: the rollout loop's threads
(admission, watchdog) stay in the driver and call the actors through two proxies that keep
the runtime's contracts — ``RayRolloutBackend`` is a ``RolloutBackend`` (weights travel as a
CPU state dict through the object store), ``RayReward`` is a reward function with
``score_batch`` (round robin over the reward actors). The trainer runs in the driver.

Invariant (same as local): the rollout actor owns its own copy of the weights; with the HF
backend it runs one call at a time (max_concurrency=1), so an update never lands inside a
``generate``; with the engine, two calls may overlap and the engine swaps weights between
steps (in-flight update).
"""
from __future__ import annotations

import itertools
import threading
from typing import Iterable

import torch

from asyncrl.data.sources import score_responses
from asyncrl.runtime.executors.local import LocalExecutor

ray = None  # imported on first use: Ray is an optional dependency (asyncrl[ray])


def _ray():
    global ray
    if ray is None:
        import ray as _ray_module

        ray = _ray_module
    return ray


class RolloutWorker:
    """Holds the rollout backend in the actor process."""

    def __init__(self, backend_name: str, model, tokenizer, version: int, kv_on_update: str = "keep"):
        torch.set_num_threads(1)
        if backend_name == "engine":
            from asyncrl.rollout.engine_backend import EngineBackend

            self.backend = EngineBackend(model, tokenizer, version=version, device="cpu", kv_on_update=kv_on_update)
        else:
            from asyncrl.rollout.hf import HFGenerateBackend
            from asyncrl.runtime.weight_sync import clone_for_rollout

            self.backend = HFGenerateBackend(clone_for_rollout(model), tokenizer, version)

    def generate(self, prompt_token_ids, params):
        return self.backend.generate(prompt_token_ids, params)

    def update_weights(self, state: dict, version: int) -> int:
        self.backend.update_weights(state.items(), version)
        return self.backend.version

    def pid(self) -> int:
        import os

        return os.getpid()


class RewardWorker:
    def __init__(self, reward_fn):
        self.reward_fn = reward_fn

    def score_batch(self, prompts, responses, fields) -> list[float]:
        return score_responses(self.reward_fn, prompts, responses, fields)


class RayRolloutBackend:
    """``RolloutBackend`` over a ``RolloutWorker`` actor. ``version`` changes only after the
    actor confirmed the new weights."""

    def __init__(self, actor, version: int, inflight: bool):
        self.actor, self.version, self.inflight_weight_update = actor, version, inflight

    def generate(self, prompt_token_ids, params):
        return _ray().get(self.actor.generate.remote(prompt_token_ids, params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        state = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        self.version = _ray().get(self.actor.update_weights.remote(state, version))


class RayReward:
    """The reward contract over ``RewardWorker`` actors (a group's batch goes to one actor)."""

    def __init__(self, actors):
        self.actors = actors
        self._next = itertools.cycle(range(len(actors)))
        self._lock = threading.Lock()

    def score_batch(self, prompts, responses, fields) -> list[float]:
        with self._lock:
            actor = self.actors[next(self._next)]
        return _ray().get(actor.score_batch.remote(list(prompts), list(responses), [dict(f) for f in fields]))

    def __call__(self, prompt: str, response: str, **fields) -> float:
        return self.score_batch([prompt], [response], [fields])[0]


def ray_roles(cfg, model, tokenizer, reward_fn, log_dir=None):
    """(rollout backend proxy, reward proxy, placement group of the actors it placed): one
    rollout actor, or with ``rollout.engines`` > 1 / ``tensor_parallel_size`` > 1 a fleet of
    replica actors in their own placement group (ray_replicas.py; replica logs in ``log_dir``)."""
    r = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from asyncrl.rollout.registry import resolve_backend_name
    from asyncrl.runtime.executors.ray_cluster import init_ray_for

    init_ray_for(cfg)  # RAY_ADDRESS (a cluster), or a local Ray of runtime.ray_num_cpus
    fleet = cfg.rollout.engines > 1 or cfg.rollout.tensor_parallel_size > 1
    n_reward = cfg.runtime.reward_workers
    reward_cpus = 1.0 / n_reward
    first_reward = 0 if fleet else 1
    pg = placement_group([{"CPU": 1}] * first_reward + [{"CPU": reward_cpus}] * n_reward, strategy="PACK")
    r.get(pg.ready(), timeout=60)
    backend_name = resolve_backend_name(cfg.rollout.backend, model)
    engine = backend_name == "engine"
    in_bundle = lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
    if fleet:
        rollout = _ray_fleet(cfg, model, tokenizer, backend_name, log_dir)
    else:
        actor = r.remote(RolloutWorker).options(num_cpus=1, max_concurrency=2 if engine else 1,
                                                scheduling_strategy=in_bundle(0)).remote(
            backend_name, model, tokenizer, 0, cfg.runtime.partial_rollout_kv)
        rollout = RayRolloutBackend(actor, 0, inflight=engine)
    rewards = [r.remote(RewardWorker).options(num_cpus=reward_cpus,
                                              scheduling_strategy=in_bundle(first_reward + i)).remote(reward_fn)
               for i in range(n_reward)]
    return rollout, RayReward(rewards), pg


def _ray_fleet(cfg, model, tokenizer, backend_name: str, log_dir):
    from asyncrl.metrics.console import console
    from asyncrl.rollout.registry import engine_options
    from asyncrl.runtime.async_controller import _announce_restart
    from asyncrl.runtime.executors.ray_cluster import replicas_on_gpu
    from asyncrl.runtime.executors.ray_replicas import start_ray_fleet

    r = cfg.rollout
    return start_ray_fleet(model, tokenizer, backend_name, engines=r.engines, tensor_parallel_size=r.tensor_parallel_size,
                           on_gpu=replicas_on_gpu(cfg), strategy=r.ray_strategy,
                           kv_on_update=cfg.runtime.partial_rollout_kv, dtype=getattr(torch, cfg.model.dtype),
                           engine_options=engine_options(r), log_dir=log_dir, start_timeout_s=r.replica_start_timeout_s,
                           on_lost=lambda message: console.print(f"[bold yellow]fleet[/] {message}"),
                           hang_timeout_s=cfg.runtime.hang_timeout_s, max_restarts=cfg.runtime.max_restarts,
                           on_restart=_announce_restart)


class RayExecutor(LocalExecutor):
    """Driver-side threads as in the local executor; the placement group is removed on stop."""

    def __init__(self, loop, inflight, num_workers: int, reward_workers: int, placement_group):
        super().__init__(loop, inflight, num_workers, reward_workers)
        self.placement_group = placement_group

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)
