"""The trainer's data-parallel group: who this rank is, how many ranks there are, and the few
collectives the roles need (broadcast of the scored batch, row gathers, metric sums).

Processes join through torchrun's environment contract (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), whoever set it: ``torchrun``, the
``trainer.gpus=N`` launcher (launch.py) or a Ray actor (ray_launch.py). A test (or a user's
script) that already called ``init_process_group`` is joined as is.

Invariant: every collective method is called by every rank in the same order; methods of
:data:`SINGLE` (one process, no process group) are the identity, so role code has no
``if distributed`` branches.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncrl.config_schema import ConfigError

STRATEGIES = ("auto", "single", "fsdp2")
CONTROL_TIMEOUT = timedelta(days=7)


@dataclass
class DataParallel:
    """One rank of the trainer's data-parallel group.

    rank / world_size / local_rank: as torchrun defines them. device: this rank's device
    (``cuda:<local_rank>`` or cpu). mesh: the 1-D DeviceMesh ``("dp_shard",)`` FSDP2 shards
    over (None for the single-process strategy). lockstep: True when the other ranks replay
    rank 0's calls (the training job); False when every rank runs the same code (SPMD: tests,
    scripts)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Optional[torch.device] = None
    mesh: Any = None
    lockstep: bool = False  # rank 0 announces its replicated calls to followers in serve() (lockstep.py)
    control: Any = None  # a gloo group without a practical timeout for those announcements (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """True when the roles' models are FSDP2-sharded over ``mesh`` (any world size, 1 included)."""
        return self.mesh is not None

    @property
    def _collective(self) -> bool:
        return self.world_size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return self.device
        return torch.device("cpu")

    # collectives -------------------------------------------------------------------------

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for the scored batch and small records)."""
        if not self._collective:
            return obj
        box = [obj if self.is_main else None]
        if self.control is not None:  # CPU pickles over gloo: no device sync, no collective timeout
            dist.broadcast_object_list(box, src=0, group=self.control)
        else:
            dist.broadcast_object_list(box, src=0, device=self.comm_device)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self._collective:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Key-wise sum over ranks (a key missing on a rank counts as 0 there)."""
        if not self._collective:
            return metrics
        total: dict[str, float] = {}
        for part in self.gather_objects(metrics):
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on at least one."""
        if not self._collective:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.comm_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a tensor on this rank's device (returned)."""
        if self._collective:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather_rows(self, local: torch.Tensor, rows_per_rank: list[torch.Tensor], total: int) -> torch.Tensor:
        """Scatter every rank's ``local`` [b_r, ...] to its global row positions
        ``rows_per_rank[r]`` [b_r] in a [total, ...] tensor, on every rank (on ``local``'s device).

        Ranks hold different row counts, so each pads to the largest before the all-gather."""
        if not self._collective:
            out = local.new_zeros((total, *local.shape[1:]))
            return out.index_copy(0, rows_per_rank[0].to(local.device), local)
        widest = max(len(rows) for rows in rows_per_rank)
        padded = local.new_zeros((widest, *local.shape[1:]))
        padded[:local.shape[0]] = local
        home = local.device
        parts = [torch.empty_like(padded, device=self.comm_device) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.to(self.comm_device))
        out = local.new_zeros((total, *local.shape[1:]))
        for rows, part in zip(rows_per_rank, parts):
            out.index_copy_(0, rows.to(home), part[:len(rows)].to(home))
        return out

    def barrier(self) -> None:
        if self._collective:
            dist.barrier()


SINGLE = DataParallel()  # one process, no process group: every collective is the identity


def resolve_strategy(strategy: str, world_size: int) -> str:
    """``auto``: fsdp2 when the world has more than one rank, else single."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"trainer.strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "auto":
        return "fsdp2" if world_size > 1 else "single"
    if strategy == "single" and world_size > 1:
        raise ConfigError(f"trainer.strategy=single cannot run {world_size} ranks (WORLD_SIZE={world_size}): "
                          "use trainer.strategy=fsdp2 (or auto)")
    return strategy


def env_world_size() -> int:
    """WORLD_SIZE from the launch environment (1 outside torchrun / the launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """This rank's device from ``trainer.device``: ``cuda:<local_rank>`` or cpu."""
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device_name == "auto" else device_name
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but torch.cuda.is_available() is False on this machine: "
                          "set trainer.device=cpu (ranks then talk over gloo)")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"local rank {local_rank} has no GPU: this machine has {count} CUDA device(s); launch at "
                          f"most {count} ranks per node (trainer.gpus / torchrun --nproc-per-node)")
    return torch.device("cuda", local_rank)


def check_local_ranks(trainer_cfg, nproc: int, local: bool = True) -> None:
    """Before launching ``nproc`` ranks: a strategy able to use them; on this machine
    (``local``), a GPU for each and a backend this machine has (named errors)."""
    resolve_strategy(trainer_cfg.strategy, nproc)
    if local:
        comm_backend(trainer_cfg.dist_backend, rank_device(trainer_cfg.device, nproc - 1))


def comm_backend(name: str, device: torch.device) -> str:
    """``trainer.dist_backend``: auto = nccl between GPUs, gloo between CPU ranks."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise ConfigError("trainer.dist_backend=nccl needs CUDA GPUs, but this rank runs on the CPU "
                          f"(trainer.device={device.type}, torch.cuda.is_available()={torch.cuda.is_available()}): "
                          "use trainer.dist_backend=gloo (or auto) for CPU ranks")
    return name


def init_distributed(trainer_cfg) -> DataParallel:
    """This process's :class:`DataParallel` for ``trainer`` (strategy, device, dist_backend,
    dist_timeout_s). Single strategy: :data:`SINGLE`-like, no process group. fsdp2: joins the
    group the environment describes (world 1 included: one rank, sharding is a no-op)."""
    world = dist.get_world_size() if dist.is_initialized() else env_world_size()
    strategy = resolve_strategy(trainer_cfg.strategy, world)
    if strategy == "single":
        return SINGLE
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", rank if world > 1 else 0))
    device = rank_device(trainer_cfg.device, local_rank)
    if not dist.is_initialized():
        backend = comm_backend(trainer_cfg.dist_backend, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=_rendezvous(world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=trainer_cfg.dist_timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    # Followers wait for rank 0's next call while it generates, scores or evaluates alone, for
    # as long as that takes: they wait on a group of their own, not under dist_timeout_s.
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if world > 1 else None
    return DataParallel(rank=rank, world_size=world, local_rank=local_rank, device=device, mesh=mesh,
                        control=control)


def shutdown(dp: DataParallel) -> None:
    """Leave the process group (end of a sharded job)."""
    if dp.sharded and dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous(world: int) -> str:
    """torchrun's ``env://`` contract; a one-rank fsdp2 run started without a launcher gets a
    local address and a free port instead (the environment is left as it is)."""
    if "MASTER_ADDR" in os.environ or world > 1:
        return "env://"
    return f"tcp://127.0.0.1:{free_port()}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
