"""Ranks 1..k-1 of a tensor-parallel engine, and rank 0's handle on them (``TPFollowers``).

    rank 0 (the LLM's process)                          rank r (a spawned worker)
      Scheduler -> ModelRunner.prepare -> StepInputs ──pipe──► ModelRunner.execute(step)
      ModelRunner.execute(step)   ◄══ all-reduce / gather / broadcast (TPComm) ══►  same calls
      load weights: names + shapes ──pipe──► each full tensor broadcast ══► load_weights (slice)

The scheduler, block manager and sampler run once, on rank 0 (nano-vllm's and vLLM's
design); a worker only runs the device side of each step, in the order rank 0 sends them.
Host messages go over one pipe per worker: cheap on one host, and a dead rank 0 reads as EOF,
so its workers exit instead of waiting on a collective that never comes.

Invariant: rank 0 sends a message before it enters the collectives the message implies, and
the workers handle messages in order, so all ranks issue the same collectives in the same order.
"""
from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.multiprocessing as mp

from asyncrl.engine.config import EngineConfig
from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.parallel.comm import TPComm
from asyncrl.engine.parallel.layout import TensorParallel, check_tensor_parallel

START_TIMEOUT_S = 300.0  # a worker imports torch and builds its shard; a loaded machine is slow


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed (its traceback is in the message) or died."""


@dataclass
class WorkerSpec:
    """What a worker needs to build its shard; ``source``: a checkpoint dir every rank reads,
    or None: rank 0 broadcasts the weights (an in-memory HF module)."""

    source: Optional[str]
    config: ModelConfig
    dtype: torch.dtype
    engine: EngineConfig
    max_model_len: int
    port: int
    size: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of an engine on ``cuda:i`` runs on ``cuda:i+r``; on CPU every rank is ``cpu``."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, size: int) -> None:
    """An engine of ``size`` ranks from ``cuda:i`` needs GPUs i..i+size-1: say so before spawning."""
    if device.type != "cuda":
        return
    first, visible = device.index or 0, torch.cuda.device_count()
    if first + size > visible:
        raise ValueError(f"tensor_parallel_size={size} from {device} needs cuda:{first}..cuda:{first + size - 1}, "
                         f"but {visible} GPU(s) are visible")


class TPFollowers:
    """Rank 0's handle on ranks 1..size-1: the ``followers`` of its ``ModelRunner``."""

    def __init__(self, processes, conns, comm: TPComm):
        self.processes, self.conns, self.comm = processes, conns, comm
        self.closed = False

    @classmethod
    def launch(cls, source: Optional[str], config: ModelConfig, dtype: torch.dtype, device: torch.device,
               engine: EngineConfig, max_model_len: int) -> "TPFollowers":
        """Spawn the workers and join the group with them (returns once all have joined)."""
        size = engine.tensor_parallel_size
        check_tensor_parallel(config, size)
        check_devices(device, size)
        if multiprocessing.current_process().daemon:
            raise TPWorkerError(f"tensor_parallel_size={size} spawns {size - 1} worker process(es), which a daemonic "
                                "process cannot do: build this engine in a non-daemonic process")
        store = TPComm.host_store(size)
        spec = WorkerSpec(source, config, dtype, engine, max_model_len, store.port, size)
        ctx = mp.get_context("forkserver")  # one server imports torch once; each worker is a cheap fork of it
        ctx.set_forkserver_preload([__name__])  # (no CUDA in the server: every worker initialises its own GPU)
        processes, conns = [], []
        for rank in range(1, size):
            conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(rank, spec, str(rank_device(device, rank)), child_conn),
                                  name=f"asyncrl-tp{rank}", daemon=True)
            process.start()
            child_conn.close()  # a dead worker then reads as EOF here
            processes.append(process)
            conns.append(conn)
        followers = cls(processes, conns, None)
        try:
            followers._expect("joining")  # alive and past its imports: the group can form
            followers.comm = TPComm(store, 0, size, device)
        except BaseException:
            followers.close()
            raise
        return followers

    # ---- what rank 0 asks ----------------------------------------------------------------
    def run_step(self, step) -> None:
        """Send one step's ``StepInputs`` (rank 0 then executes it too)."""
        self._check()
        self._send(("step", step))

    def broadcast_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """Send full HF tensors to every worker (each loads its slice) and yield each one for
        rank 0's own ``load_weights``. Consume it to the end: the workers expect every tensor."""
        tensors = [(name, t.detach()) for name, t in named_tensors]
        self._send(("weights", [(name, tuple(t.shape), t.dtype) for name, t in tensors]))
        for name, tensor in tensors:
            tensor = tensor.to(self.comm.device).contiguous()  # NCCL sends from rank 0's GPU
            self.comm.broadcast(tensor)
            yield name, tensor

    def wait_ready(self) -> None:
        """Return once every worker built its shard and runner (or raise its error)."""
        self._expect("ready")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (killed if they do not stop in time) and free the group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)
        for conn in self.conns:
            conn.close()
        if self.comm is not None:
            self.comm.close()

    # ---- pipes ------------------------------------------------------------------------------
    def _send(self, message) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (OSError, ValueError) as err:
                raise TPWorkerError(f"tensor-parallel worker {rank} is gone ({err!r}); {self._exit(rank)}") from None

    def _check(self) -> None:
        """Raise the first error a worker reported (it sends one, then exits)."""
        for rank, conn in enumerate(self.conns, start=1):
            if conn.poll():
                self._raise(rank, self._recv(rank))

    def _expect(self, kind: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(1.0):
                if not self.processes[rank - 1].is_alive() or time.monotonic() > deadline:
                    raise TPWorkerError(f"tensor-parallel worker {rank} did not get to '{kind}': {self._exit(rank)}")
            message = self._recv(rank)
            if message[0] != kind:
                self._raise(rank, message)

    def _recv(self, rank: int):
        try:
            return self.conns[rank - 1].recv()
        except (EOFError, OSError):
            self.processes[rank - 1].join(5.0)
            raise TPWorkerError(f"tensor-parallel worker {rank} died; {self._exit(rank)}") from None

    def _raise(self, rank: int, message) -> None:
        detail = message[1] if message[0] == "error" else f"unexpected message {message[0]!r}"
        raise TPWorkerError(f"tensor-parallel worker {rank} failed:\n{detail}")

    def _exit(self, rank: int) -> str:
        process = self.processes[rank - 1]
        return f"pid {process.pid}, exit code {process.exitcode}"


def worker_main(rank: int, spec: WorkerSpec, device: str, conn) -> None:
    """Rank ``rank``: join the group, build and fill this rank's shard and runner, then execute
    rank 0's messages until "stop" or EOF. A failure is reported with its traceback."""
    from asyncrl.engine.model_runner import ModelRunner
    from asyncrl.engine.models.loader import build_model, fill_weights, iter_safetensors

    try:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the host's cores shared by the ranks (rank 0 included)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
        conn.send(("joining",))
        comm = TPComm.join(spec.port, rank, spec.size, device)
        model = build_model(spec.config, spec.dtype, device, TensorParallel(spec.size, rank, comm),
                            spec.engine.quantization, spec.engine.fp8_scaling)
        if spec.source is not None:
            fill_weights(model, iter_safetensors(spec.source))
        else:
            fill_weights(model, _received_weights(conn, comm, device))
        runner = ModelRunner(model, spec.engine, spec.max_model_len)
        conn.send(("ready",))
        _serve(conn, runner, comm, device)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass


def _serve(conn, runner, comm: TPComm, device: torch.device) -> None:
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if kind == "step":
            runner.execute(args[0])
        elif kind == "weights":
            runner.model.load_weights(_received_weights(conn, comm, device, specs=args[0]))
        elif kind == "stop":
            break
    comm.close()


def _received_weights(conn, comm: TPComm, device: torch.device, specs=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors rank 0 broadcasts after a "weights" message (read here if not given)."""
    if specs is None:
        kind, specs = conn.recv()
        if kind != "weights":
            raise TPWorkerError(f"expected the weights from rank 0, got {kind!r}")
    for name, shape, dtype in specs:
        yield name, comm.broadcast(torch.empty(shape, dtype=dtype, device=device))
