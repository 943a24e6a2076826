"""Run a function on N gloo ranks from a test (``run_ranks``), the way SCALE.md §5 describes:
a FileStore rendezvous (no port collisions), ``OMP_NUM_THREADS=1``, a 300 s collective timeout (a rank of a loaded 2-core machine
may spend over a minute before the next collective: seen with the LoRA checkpoint tests).

Ranks are forked from the test process: they inherit its imported torch and transformers, so
a rank starts in well under a second instead of ~5 s per spawned interpreter on 2 cores.
"""
from __future__ import annotations

import os
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, store: str, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():  # the job may have left the group itself
            dist.destroy_process_group()


def run_ranks(world: int, tmp_path: Path, fn, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` forked gloo ranks; a failure in any rank fails the test."""
    store = tmp_path / f"store-{world}-{uuid.uuid4().hex}"  # a fresh rendezvous file per run
    mp.start_processes(_rank_main, args=(world, str(store), fn, args), nprocs=world, join=True,
                       start_method="fork")
