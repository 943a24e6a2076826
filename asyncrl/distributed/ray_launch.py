"""Trainer ranks as Ray actors (``runtime.executor=ray`` with ``trainer.gpus=N``): N actors in
one placement group, on any number of nodes of the Ray cluster, each given torchrun's
environment contract and running the same command line (verl's Ray launcher does the same).

    placement group (PACK): N x [{CPU: 1, GPU: 1}]     (no GPU key with trainer.device=cpu)
    rank 0's node address and a free port on it -> MASTER_ADDR / MASTER_PORT of every rank
    RANK = i, WORLD_SIZE = N, LOCAL_RANK = 0           (Ray gives each actor one visible GPU)

Ray is joined at ``RAY_ADDRESS`` (an existing cluster, multi-node) or started locally with
``runtime.ray_num_cpus``. When a rank fails, the others are killed and the failed rank named.
"""
from __future__ import annotations

import os
from typing import Callable

from asyncrl.distributed.group import free_port

class TrainerRank:
    """One rank's process: where it runs, then the job with the rank's environment."""

    def address(self) -> tuple[str, int]:
        import ray  # an optional dependency (asyncrl[ray]): imported where used

        return ray.util.get_node_ip_address(), free_port()

    def run(self, env: dict[str, str], entry: Callable[[list[str]], int], argv: list[str]) -> int:
        os.environ.update(env)
        return entry(argv)


def rank_env(rank: int, world: int, master: tuple[str, int]) -> dict[str, str]:
    """torchrun's variables for ``rank`` (LOCAL_RANK 0: Ray shows each actor its one GPU)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "OMP_NUM_THREADS": "1"}


def launch_ray(nproc: int, entry: Callable[[list[str]], int], argv: list[str], gpus: bool,
               num_cpus: int | None = None) -> int:
    """Run ``entry(argv)`` on ``nproc`` Ray actors (see module doc); 0 when all succeeded."""
    import ray as r
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not r.is_initialized():
        r.init(address=os.environ.get("RAY_ADDRESS"), num_cpus=None if os.environ.get("RAY_ADDRESS") else num_cpus,
               include_dashboard=False, log_to_driver=True)
    bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
    group = placement_group([bundle] * nproc, strategy="PACK")
    r.get(group.ready(), timeout=600)
    actors = [r.remote(TrainerRank).options(
        num_cpus=1, num_gpus=1 if gpus else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
    ).remote() for i in range(nproc)]
    try:
        master = r.get(actors[0].address.remote())
        runs = {actor.run.remote(rank_env(i, nproc, master), entry, argv): i for i, actor in enumerate(actors)}
        return _wait(runs, actors, nproc)
    finally:
        for actor in actors:
            r.kill(actor)
        remove_placement_group(group)


def _wait(runs: dict, actors: list, nproc: int) -> int:
    """Wait for every rank; at the first failure, report it (the caller kills the rest)."""
    import ray as r

    pending = list(runs)
    while pending:
        done, pending = r.wait(pending, num_returns=1)
        rank = runs[done[0]]
        try:
            code = r.get(done[0])
        except Exception as err:  # a crashed actor (RayActorError) or an exception in the rank
            print(f"asyncrl: rank {rank} of {nproc} failed ({type(err).__name__}); the other ranks were stopped:\n"
                  f"{err}", flush=True)
            return 1
        if code:
            print(f"asyncrl: rank {rank} of {nproc} exited with code {code}; the other ranks were stopped", flush=True)
            return 1
    return 0
