"""Trainer ranks as Ray actors: each actor gets torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR/PORT of rank 0's node), so the job's own ``init_process_group`` joins them into one
gloo group. (A failing rank is named and the others killed: checked by hand, 2026-12-01, not in
CI: each Ray launch starts fresh actor processes, ~30 s of a 2-core machine.)"""
import signal

import pytest

ray = pytest.importorskip("ray")

from asyncrl.distributed.ray_launch import launch_ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()
    for sig, handler in handlers.items():  # ray.init installs its own: later tests expect the defaults
        signal.signal(sig, handler)


def _entry():
    def entry(argv):  # runs in each actor (pickled by value)
        import os
        from datetime import timedelta
        from pathlib import Path

        import torch
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env:// from the launcher
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        Path(argv[0], f"rank{rank}").write_text(f"{total.item()} {world} {os.environ['LOCAL_RANK']}")
        dist.destroy_process_group()
        return 0
    return entry


@pytest.mark.ray
def test_ranks_join_one_group_through_the_env_contract(local_ray, tmp_path):
    assert launch_ray(2, _entry(), [str(tmp_path)], gpus=False) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3.0 2 0", "3.0 2 0"]
