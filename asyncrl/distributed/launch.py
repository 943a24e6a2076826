"""``asyncrl train ... trainer.gpus=N``: start N local ranks with torchrun's environment contract.

Each rank is a fresh interpreter (``torch.multiprocessing`` spawn; CUDA cannot be forked)
that gets ``RANK = LOCAL_RANK = i``, ``WORLD_SIZE = LOCAL_WORLD_SIZE = N`` and a free
``MASTER_PORT`` on 127.0.0.1, then runs the same command line as the parent: exactly what it
would run under ``torchrun --standalone --nproc-per-node N -m asyncrl train ...``.

When a rank dies, the others are stopped at once (``ProcessContext.join`` terminates them)
and the launcher names the rank that failed first and how; the ranks' own logs are in
``<run_dir>/logs/rank_<r>.log``. The last complete checkpoint is untouched: a step directory
is only renamed into place after every rank finished writing it.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable

import torch.multiprocessing as mp

from asyncrl.distributed.group import free_port

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_launcher() -> bool:
    """True inside torchrun, a Ray trainer actor or this launcher (the world is already set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _rank_main(local_rank: int, world: int, port: int, entry: Callable[[list[str]], int], argv: list[str]) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
    code = entry(argv)
    if code:
        sys.exit(code)


def launch_local(nproc: int, entry: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run ``entry(argv)`` on ``nproc`` local ranks; 0 when every rank succeeded, else 1 after
    printing which rank failed first."""
    try:
        mp.start_processes(_rank_main, args=(nproc, free_port(), entry, argv), nprocs=nproc, join=True,
                           start_method="spawn")
    except mp.ProcessExitedException as err:
        print(f"asyncrl: {describe_failure(err.error_index, err.exit_code, nproc)}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as err:
        print(f"asyncrl: rank {err.error_index} of {nproc} raised an exception (the other ranks were stopped):\n"
              f"{err}", file=sys.stderr)
        return 1
    return 0


def describe_failure(rank: int, exit_code: int, world: int) -> str:
    """One line naming the dead rank and its exit code or signal."""
    if exit_code < 0:
        try:
            how = f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            how = f"killed by signal {-exit_code}"
    else:
        how = f"exited with code {exit_code}"
    return (f"rank {rank} of {world} {how}; the other ranks were stopped. Its log: <run_dir>/logs/rank_{rank}.log; "
            "the last complete checkpoint is <run_dir>/checkpoints/latest")
