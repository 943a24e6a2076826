"""Weights from the trainer to the rollout process by a torch.distributed broadcast
(``runtime.weight_transport=collective``): NCCL between GPUs, gloo between CPU processes.

    trainer (rank 0)                                   rollout process (rank 1; a fleet: 1..N)
      params ─copy─► FlatWeights (its device) ══ broadcast ══► FlatWeights (rollout device)
                                                                  └ views = the child's module's
                                                                    parameters (probe reference)

The shared-memory transport (the default) hands the child the trainer's tensors (shared CPU
memory or CUDA IPC) and the child reads them across the bus; this one moves the bytes with one
collective per dtype into a copy the child owns on its own device: NVLink bandwidth between two
GPUs, no peer mapping, the same code across hosts. verl and OpenRLHF sync weights to their
rollout workers the same way (an NCCL group beside the training group).

The group is made from a private ``TCPStore`` (``ProcessGroupNCCL`` / ``ProcessGroupGloo``
constructed directly), never from the default process group: the trainer may run a
torch.distributed job of its own.
"""
from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # both ranks on one host (the rollout process is spawned by the trainer)
TIMEOUT = datetime.timedelta(seconds=300)


class FlatWeights:
    """Named tensors stored as views into one contiguous buffer per dtype.

    Invariant: ``views[name]`` aliases ``buffers[dtype][offset : offset + numel]``, so one
    broadcast of each buffer moves every tensor at once (a Qwen3-0.6B has ~310 tensors: one
    collective each would pay ~310 launches and rendezvous per sync)."""

    def __init__(self, specs: list[tuple[str, torch.Size, torch.dtype]], device: torch.device | str):
        self.specs = list(specs)
        sizes: dict[torch.dtype, int] = {}
        for _, shape, dtype in self.specs:
            sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
        self.buffers = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self.views: dict[str, torch.Tensor] = {}
        for name, shape, dtype in self.specs:
            n = shape.numel()
            self.views[name] = self.buffers[dtype][offsets[dtype]:offsets[dtype] + n].view(shape)
            offsets[dtype] += n

    @staticmethod
    def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(name, t.shape, t.dtype) for name, t in named_tensors]

    @torch.no_grad()
    def copy_from(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self.views[name].copy_(tensor.detach())

    def ordered_buffers(self) -> list[torch.Tensor]:
        """The buffers in a fixed order (both ranks build them from the same specs)."""
        return [self.buffers[dtype] for dtype in sorted(self.buffers, key=str)]


def weightless_clone(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no storage) and whose
    buffers (rotary ``inv_freq``, ...) are on the CPU: what the child needs to rebuild the
    module around received weights, without pickling a copy of them at spawn."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            for p in model.parameters()}
    clone = copy.deepcopy(model, memo).eval()
    for module in clone.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.cpu()
    return clone


def attach_weights(module: torch.nn.Module, views: dict[str, torch.Tensor], device) -> torch.nn.Module:
    """Make ``views`` the parameters of ``module`` (a :func:`weightless_clone`) and move its
    buffers to ``device``. Tied parameters (one Parameter under two names) stay tied: every
    module slot holding the same meta Parameter gets the same new one."""
    replaced = {id(p): torch.nn.Parameter(views[name], requires_grad=False)
                for name, p in module.named_parameters()}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                sub._parameters[name] = replaced[id(p)]
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.to(device)
    return module


@dataclass
class ChannelAddress:
    """What a child needs to join: the store's port, the collective backend, the group's size
    (the trainer + every rollout process: one group for a whole fleet, as in OpenRLHF) and how
    long a collective may wait for the other ranks (``runtime.hang_timeout_s``)."""
    port: int
    backend: str  # "nccl" | "gloo"
    world: int = 2
    timeout_s: float = TIMEOUT.total_seconds()


def channel_backend(trainer_device: torch.device, rollout_device: torch.device) -> str:
    """NCCL between two CUDA devices, gloo between two CPU processes; a mix is refused."""
    kinds = {torch.device(trainer_device).type, torch.device(rollout_device).type}
    if kinds == {"cuda"}:
        return "nccl"
    if kinds == {"cpu"}:
        return "gloo"
    raise ValueError(f"runtime.weight_transport=collective needs the trainer ({trainer_device}) and the rollout "
                     f"process ({rollout_device}) on the same kind of device (two GPUs: NCCL, two CPUs: gloo); "
                     "use runtime.weight_transport=shared")


def host_store(backend: str, world: int = 2, timeout_s: float | None = None) -> tuple[dist.TCPStore, ChannelAddress]:
    """The trainer's side of the rendezvous: a store on a free port (rank 0 is its master);
    ``timeout_s`` bounds every collective of the channel on every rank."""
    store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    address = ChannelAddress(store.port, backend, world)
    if timeout_s is not None:
        address.timeout_s = timeout_s
    return store, address


class WeightChannel:
    """One group: rank 0 the trainer (source of every broadcast), ranks 1..world-1 the rollout
    processes. All must call :meth:`broadcast` for each sync, in the same order (the trainer
    announces each sync over the pipes first, so every child enters the same collective)."""

    def __init__(self, store: dist.Store, address: ChannelAddress, rank: int):
        """A broadcast waiting longer than ``address.timeout_s`` for the other rank fails
        instead of hanging the run (a dead or wedged rollout process)."""
        self.rank, self.backend = rank, address.backend
        timeout = datetime.timedelta(seconds=address.timeout_s)
        self._stamp_tensor: torch.Tensor | None = None
        self.bytes_moved = 0  # weight bytes this rank put into broadcasts (sent or received), stamps excluded
        if address.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, address.world, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, address.world, timeout)

    @classmethod
    def join(cls, address: ChannelAddress, rank: int = 1) -> "WeightChannel":
        """A child's side: connect to the trainer's store and build the group as ``rank``."""
        store = dist.TCPStore(HOST, address.port, address.world, is_master=False, timeout=TIMEOUT)
        return cls(store, address, rank=rank)

    def broadcast(self, flat: FlatWeights, version: int) -> list:
        """Start the broadcast of every buffer, then of ``version`` (the stamp), from rank 0;
        returns the works (``wait`` each). NCCL orders it after the work already queued on the
        current stream (the copies into the buffers): the sender does not synchronize."""
        stamp = self._stamp(flat)
        stamp.fill_(version)  # a kernel on the current stream, not a host copy (which would wait)
        buffers = flat.ordered_buffers()
        self.bytes_moved += sum(buffer.numel() * buffer.element_size() for buffer in buffers)
        return [self.group.broadcast(buffer, 0) for buffer in [*buffers, stamp]]

    def receive(self, flat: FlatWeights, version: int) -> None:
        """A receiving rank: block until every buffer holds the broadcast bytes (visible to any stream);
        raise if the broadcast was stamped with another version than the pipe announced."""
        for work in self.broadcast(flat, -1):
            work.wait()  # NCCL: orders the current stream after the receive
        # .item() waits on the host for the current stream, so for the whole receive: the
        # buffers are complete for readers on any stream when it returns
        got = int(self._stamp(flat).item())
        if got != version:
            raise RuntimeError(f"weight broadcast out of step: it carries version {got}, the trainer announced "
                               f"{version}")

    def _stamp(self, flat: FlatWeights) -> torch.Tensor:
        """A one-element int64 tensor on the buffers' device, kept (filled per sync)."""
        if self._stamp_tensor is None:
            device = next(iter(flat.buffers.values())).device
            self._stamp_tensor = torch.zeros(1, dtype=torch.int64, device=device)
        return self._stamp_tensor

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)  # NCCL: free the communicator now
        if shutdown is not None and self.backend == "nccl":
            try:
                shutdown()
            except RuntimeError:
                pass
