"""The device collectives of one tensor-parallel engine.

NCCL between GPUs, gloo on CPU, over a private ``TCPStore`` (``ProcessGroupNCCL`` /
``ProcessGroupGloo`` built directly, as ``runtime/executors/weight_channel.py`` does): never the
default process group, which the trainer may own. The raw ``ProcessGroup`` methods are used
(``allreduce``, ``gather``, ``broadcast``), so nothing needs registering in torch's group table.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # tensor parallelism stays inside one host
TIMEOUT = datetime.timedelta(seconds=300)


class TPComm:
    """Collectives among the ``size`` ranks of one engine; rank 0 owns the scheduler.

    Invariant: every rank issues the same collectives in the same order. Rank 0 decides what
    runs; the other ranks only do what its messages say (``worker.py``), step after step."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device | str):
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.store = store  # kept alive: the group's rendezvous lives in it
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)

    @staticmethod
    def host_store(size: int) -> dist.TCPStore:
        """Rank 0's side of the rendezvous: a store on a free port (``store.port``)."""
        return dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

    @classmethod
    def join(cls, port: int, rank: int, size: int, device) -> "TPComm":
        """A worker's side: connect to rank 0's store and build the group."""
        return cls(dist.TCPStore(HOST, port, size, is_master=False, timeout=TIMEOUT), rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (a row-parallel layer's partial outputs)."""
        self.group.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> Optional[torch.Tensor]:
        """Rank 0: the ranks' ``x [S, w]`` side by side, cut to ``[S, width]`` (vocabulary
        shards -> full logits); other ranks: None."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [x], opts).wait()
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=1)[:, :width]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        self.group.broadcast(x, 0).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV blocks that fit on every GPU)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.group.allreduce([t], dist.ReduceOp.MIN).wait()
        return int(t.item())

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None and self.device.type == "cuda":
            try:
                shutdown()
            except RuntimeError:
                pass
