"""The rollout backend in its own OS process (``runtime.rollout_process=true``, local executor).

    trainer process                                       rollout process (spawned)
      RolloutLoop thread ── generate(ids, params) ──► pipe ──► worker thread: backend.generate
      WeightSync.push ── copy into shared tensors,          main thread: backend.update_weights(
                         send the version only ──► pipe ──►     shared tensors, version)
      receiver thread ◄── (call id, result | traceback) ◄── pipe

The admission (staleness manager), the buffer, the reward pool and the trainer stay in the
trainer's process; only generation moves, so the two compete for cores but not for one GIL.

Weights: at start the trainer allocates one shared tensor per named parameter and hands them
to the child when it is spawned (torch.multiprocessing passes a handle, not the data): shared
CPU memory for a CPU trainer, CUDA IPC on the trainer's GPU for a GPU trainer (the child, maybe
on another GPU (``runtime.rollout_device``), copies them peer to peer). A push copies the
trainer's tensors into them and sends only the version: no weight is pickled per step. The child copies them into its engine between two engine steps (in flight, with the
engine) or between two ``generate`` calls (HF, gated in the trainer process).

``runtime.weight_transport=collective`` replaces the shared tensors by a broadcast
(executors/weight_channel.py): the child gets the module without its weights, and every push
(the first one at start) moves them by NCCL (two GPUs) or gloo (CPU) into a copy the child owns
on its device; the pipe still carries the version and the ack. With a LoRA model a push
broadcasts only the adapters (A and B); the full set goes once per child, at its start.

Invariants:
  * the trainer writes the shared tensors only inside ``update_weights``, which returns after
    the child acknowledged loading them, so the child never reads a half-written set;
  * every call returns or raises: an exception in the child comes back with its traceback,
    and if the child dies (killed, crashed) every pending call of that child raises
    :class:`RolloutProcessDied` with its exit code; no wait outlasts ``hang_timeout_s``
    (:class:`~asyncrl.errors.HangError` names the call) — the trainer never hangs;
  * a child that died is restarted (up to ``max_restarts`` times) from the last pushed weights,
    which the trainer's shared tensors (or send buffer; LoRA over the collective: the full
    buffer, the frozen base plus the last pushed adapters) still hold, at the last announced
    version; the call that saw the death is re-sent to the new child, so a ``generate`` in
    flight returns normally (its groups keep their ids: none lost, none duplicated). Past the
    limit the death is raised. The same holds for each replica of a fleet (``RolloutProcess``,
    rollout/fleet.py), whose lost replicas are only those past the limit; a fleet on the
    ``collective`` transport cannot replace one member of its broadcast group, so there a
    death is raised at once.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import connection as mp_connection
from typing import Callable, Iterable, Optional

import torch
import torch.multiprocessing as mp

from asyncrl.errors import AsyncRLError
from asyncrl.runtime.executors.replica_server import ReplicaServer, redirect_output
from asyncrl.runtime.executors.weight_channel import (ChannelAddress, FlatWeights, WeightChannel, attach_weights,
                                                      channel_backend, host_store, weightless_clone)
from asyncrl.runtime.waits import DEFAULT_HANG_TIMEOUT_S, Deadline
from asyncrl.training.lora import is_lora, sync_tensors
from asyncrl.types import RequestOutput, SamplingParams

START_TIMEOUT_S = 300.0  # spawning imports torch and transformers; a busy machine is slow


class RolloutProcessError(AsyncRLError, RuntimeError):
    """The rollout process failed (its traceback is in the message) or died."""


class RolloutProcessDied(RolloutProcessError):
    """The rollout process is gone (killed, crashed): a restart can replace it."""


def call_with_restarts(current: Callable[[], object], call: Callable[[object], object],
                       restart_after: Callable[[object, RolloutProcessDied], None]):
    """``call(current())``; while the worker it ran on died under it, ``restart_after(dead,
    error)`` replaces it (or raises past the restart budget) and the call runs again on the new
    one. Shared by the process replica and the Ray actor replica."""
    while True:
        worker = current()
        try:
            return call(worker)
        except RolloutProcessDied as err:
            restart_after(worker, err)


class TrainerWeights:
    """The trainer's side of the weights one or more rollout processes run (one set for a whole
    fleet of replicas: written once per push, whatever the number of children).

    ``shared``: one tensor per parameter in shared CPU memory (CPU trainer) or on the trainer's
    GPU (CUDA IPC), which every child reads; a LoRA model's frozen base is the trainer's own
    tensors (never written), only the adapters are copies. ``collective``: a ``FlatWeights``
    send buffer and one broadcast group of ``world = 1 + members`` ranks: the trainer is rank 0,
    child k rank k (k = 1..members); its collectives wait at most ``hang_timeout_s``. A child
    starts from all the weights (``full``, broadcast by ``connect``); each push then broadcasts
    what a sync moves (``flat``: everything, or a LoRA model's adapters A and B). ``full`` is
    freed after ``connect`` when no child can be started again (``max_restarts == 0``, or a
    group of several members).

    ``bytes_moved``: weight bytes sent to the children so far, counted where they move: by the
    broadcast channels (the initial full broadcasts and those of closed groups included) or as
    the copies into the shared tensors.

    Invariant: ``views`` hold the weights of the last ``write`` (stamped ``announced``) until the
    next one; ``lock`` is held while they change, so a restarted child never starts from a
    half-written set."""

    def __init__(self, model: torch.nn.Module, transport: str, rollout_device: str, members: int = 1,
                 version: int = 0, hang_timeout_s: Optional[float] = None, max_restarts: Optional[int] = None):
        """``max_restarts``: how many children may be started again (None: unknown, the full
        buffer of a LoRA model on the collective transport is kept)."""
        trainer_device = next(model.parameters()).device
        self.members, self.world, self.hang_timeout_s = members, 1 + members, hang_timeout_s
        self.max_restarts = max_restarts
        self.cuda_shared = trainer_device.type == "cuda" and transport == "shared"
        self.lock = threading.Lock()
        self.announced = version  # the version the views hold
        self.store = None
        self.address: Optional[ChannelAddress] = None
        self.channel: Optional[WeightChannel] = None
        self.flat = self.full = None
        self._shared_bytes = 0  # shared transport: weight bytes the pushes copied into the shared tensors
        self._moved_by_closed_channels = 0  # collective transport: the channels of groups now closed
        if transport == "collective":
            # the trainer's send buffers ([name] -> view); the children get the module without weights
            self.backend = channel_backend(trainer_device, torch.device(rollout_device))
            self.rendezvous()
            self.full = FlatWeights(FlatWeights.specs_of(model.named_parameters()), trainer_device)
            self.full.copy_from(model.named_parameters())
            self.flat = (FlatWeights(FlatWeights.specs_of(sync_tensors(model)), trainer_device) if is_lora(model)
                         else self.full)
            if self.flat is not self.full:
                self.flat.copy_from((name, self.full.views[name]) for name in self.flat.views)
            self.views, self.child_model, self.child_views = self.flat.views, weightless_clone(model), None
        else:
            self.child_model = self._shared_reference(model)
            self.child_views = self.views

    def _shared_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A module whose parameters are shared with the children (``self.views``: [name] ->
        tensor, written by each push); a child builds its backend from it and keeps it as the
        probe's reference. CPU: shared memory. CUDA: stays on the trainer's GPU (CUDA IPC).
        A LoRA model's frozen base is the trainer's own tensors (never written): only the
        adapters are copies."""
        from asyncrl.runtime.weight_sync import clone_for_rollout

        reference = clone_for_rollout(model, share_frozen=True)
        if not self.cuda_shared:
            reference = reference.cpu()
        self.views = {n: p.data if self.cuda_shared else p.data.share_memory_()
                      for n, p in reference.named_parameters()}
        return reference

    def rendezvous(self) -> None:
        """Collective: a new store (and address) for a group of ``world`` ranks; the old group,
        if any, is closed (a restarted child joins a new group: a member cannot be replaced)."""
        self._close_channel()
        self.store, self.address = host_store(self.backend, self.world, self.hang_timeout_s)

    def _close_channel(self) -> None:
        if self.channel is not None:
            self._moved_by_closed_channels += self.channel.bytes_moved
            self.channel.close()
            self.channel = None

    @property
    def bytes_moved(self) -> int:
        """Weight bytes sent to the children so far (see the class doc). A LoRA push moves the
        adapters only; a restarted child gets all the weights again (counted too)."""
        if self.address is None:
            return self._shared_bytes
        return self._moved_by_closed_channels + (self.channel.bytes_moved if self.channel is not None else 0)

    @property
    def can_replace_member(self) -> bool:
        """A dead child can be replaced: shared tensors, or a broadcast group of one child."""
        return self.address is None or self.members == 1

    def connect(self, version: int) -> None:
        """Collective: form the group with the children (each announced it is joining) and send
        them all the weights (LoRA: the frozen base and the last written adapters), stamped
        ``version``. Shared: nothing to do."""
        if self.address is None:
            return
        if self.full is None:
            raise RolloutProcessError("the full weight buffer was freed (no child can be started again): "
                                      "cannot connect a new child")
        self.channel = WeightChannel(self.store, self.address, rank=0)
        if self.flat is not self.full:  # LoRA: the frozen base and the last written adapters
            self.full.copy_from(self.flat.views.items())
        for work in self.channel.broadcast(self.full, version):  # all the weights, once per child
            work.wait()
        if self.flat is not self.full and (self.max_restarts == 0 or not self.can_replace_member):
            self.full = None  # LoRA, no child can be started again: the frozen base never moves again

    @torch.no_grad()
    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Optional[int] = None) -> None:
        """Copy a push into ``views`` (the children must not be reading them: see the callers);
        ``version``: the version they now hold (what a child restarted from them starts at)."""
        with self.lock:
            for name, tensor in named_tensors:
                self.views[name].copy_(tensor.detach())
                if self.address is None:  # collective: the channel counts what it sends
                    self._shared_bytes += tensor.numel() * tensor.element_size()
            if self.cuda_shared:  # the children read them from their own streams: the copies must be done
                torch.cuda.synchronize(next(iter(self.views.values())).device)
            if version is not None:
                self.announced = version

    def send(self, version: int) -> list:
        """Collective: start the broadcast of the written weights (the children were told to
        enter it); returns the works to ``wait``. Shared: nothing moves, ``[]``."""
        return self.channel.broadcast(self.flat, version) if self.channel is not None else []

    def close(self) -> None:
        self._close_channel()


class _Child:
    """One rollout process and its side of the pipe: the calls waiting for its answers.

    Invariant: a failure of this child settles only this child's calls; a restart makes a new
    ``_Child``, so a late error of the dead one can never fail the calls of its replacement."""

    def __init__(self, process, conn, generation: int, name: str, log_path: Optional[str]):
        self.process, self.conn, self.generation = process, conn, generation
        self.name, self.log_path = name, log_path
        self.pending: dict[int, Future] = {}
        self.error: Optional[RolloutProcessError] = None
        self.probes_sent: set[int] = set()
        self.lock, self.send_lock = threading.Lock(), threading.Lock()
        self.joining: Optional[Future] = None  # collective: the child announced it is joining
        self.ready: Optional[Future] = None    # its pid, once its backend is built
        # one reader of the child's exit status at a time: two threads reading a forkserver child's
        # status at once (close() joining while the receiver thread joins on EOF) make one of them
        # read EOF, which multiprocessing records as exit code 255 (CPython gh-130895)
        self.exit_lock = threading.Lock()

    def is_alive(self) -> bool:
        with self.exit_lock:
            return self.process.is_alive()

    def join(self, timeout: Optional[float]) -> None:
        """Wait up to ``timeout`` for the exit (the sentinel's readiness: nothing read), then
        read the status under the lock."""
        mp_connection.wait([self.process.sentinel], timeout)
        with self.exit_lock:
            self.process.join(0)

    @property
    def exitcode(self) -> Optional[int]:
        with self.exit_lock:
            return self.process.exitcode

    def register(self, call_id: int) -> Future:
        future: Future = Future()
        with self.lock:
            if self.error is not None:
                raise self.error
            self.pending[call_id] = future
        return future

    def send(self, *message) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as err:  # the pipe is gone: the child died
            raise self.fail(RolloutProcessDied(f"{self.name} is gone ({err!r}); {self.exit_note()}"))

    def fail(self, error: RolloutProcessError) -> RolloutProcessError:
        """Every pending and later call of this child raises the first failure (returned)."""
        with self.lock:
            self.error = self.error or error
            pending, self.pending = list(self.pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(self.error)
        return self.error

    def wait(self, future: Future, timeout: Optional[float], what: str):
        """The call's result; waits in slices so a child that died without a word is noticed,
        one that lives but does not answer is reported, and no wait outlasts ``timeout``
        (:class:`~asyncrl.errors.HangError` naming ``what``)."""
        deadline = Deadline(what, timeout, hint=f"{self.name} (pid {self.process.pid}) is alive but does not "
                                                f"answer{self.log_note()}")
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self.is_alive():
                    raise self.fail(RolloutProcessDied(f"{self.name} died; {self.exit_note()}"))
                deadline.check()

    def wait_start(self, future: Future, timeout: float, what: str):
        """A start-up answer (joining, ready); past ``timeout`` the child is named with its log."""
        waited = 0.0
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                waited += 1.0
                if not self.is_alive():
                    raise self.fail(RolloutProcessDied(f"{self.name} died; {self.exit_note()}"))
                if waited >= timeout:
                    raise RolloutProcessError(f"{self.name} (pid {self.process.pid}) did not {what} within "
                                              f"{timeout:.0f}s{self.log_note()}") from None

    def receive(self) -> None:
        """Receiver thread: settle the future of each answer; on EOF fail them all."""
        while True:
            try:
                call_id, ok, payload = self.conn.recv()
            except (EOFError, OSError):
                self.join(5.0)
                self.fail(RolloutProcessDied(f"{self.name} died; {self.exit_note()}"))
                return
            if call_id is None:  # fatal: the child reports its traceback, then exits
                self.fail(RolloutProcessError(f"{self.name} failed:\n{payload}"))
                continue
            with self.lock:
                future = self.pending.pop(call_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(payload)
            else:
                future.set_exception(_child_error(*payload))

    def exit_note(self) -> str:
        return f"pid {self.process.pid}, exit code {self.exitcode}{self.log_note()}"

    def log_note(self) -> str:
        return f"; its log: {self.log_path}" if self.log_path is not None else ""


class RolloutProcess:
    """A rollout backend in a child process, called over a pipe (see module doc); weights come
    from a :class:`TrainerWeights` that may serve several such processes (a fleet).

    ``version`` changes only after the child confirmed new weights. ``log_path``: the child's
    stdout and stderr go there (named in every error about it); None: the parent's.
    ``max_restarts``: children that may die and be replaced (from the weights' last write, the
    call in flight re-sent); ``hang_timeout_s``: the longest wait for any answer;
    ``on_restart(restarts, reason)`` is told of each restart.

    Starting is split for a fleet (every replica launched, then ``wait_joining``,
    ``weights.connect``, ``wait_ready``); a restart does the same for its one child."""

    def __init__(self, weights: TrainerWeights, tokenizer, backend_name: str = "engine", version: int = 0,
                 kv_on_update: str = "keep", dtype: Optional[torch.dtype] = None,
                 engine_options: Optional[dict] = None, device: Optional[str] = None, rank: int = 1,
                 name: str = "the rollout process", log_path: Optional[str] = None, daemon: bool = True,
                 max_restarts: int = 0, hang_timeout_s: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
                 on_restart: Optional[Callable[[int, str], None]] = None, start_timeout_s: float = START_TIMEOUT_S):
        self.weights = weights
        self.version, self.backend_name, self.name, self.log_path = version, backend_name, name, log_path
        self.inflight_weight_update = backend_name == "engine"  # the engine swaps weights between steps
        self.max_restarts, self.hang_timeout_s, self.on_restart = max_restarts, hang_timeout_s, on_restart
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.closing = False  # set by close (or the controller): a child dying now is not replaced
        # close() got the child's answer to "stop", sent after its clean-up: known from the pipe,
        # not from the exit code (a forkserver child's code can be lost: it then reads 255)
        self.stopped_cleanly = False
        if log_path is not None:
            open(log_path, "a").close()  # exists from the start: a child that hangs before writing is still named
        self._child_args = (tokenizer, backend_name, kv_on_update, dtype, device, engine_options or {}, rank, daemon)
        self._ids = itertools.count()
        self.pid: Optional[int] = None
        self._child = self._launch(version, generation=0)

    def _launch(self, version: int, generation: int) -> _Child:
        """Start a child on the weights' current views at ``version`` (not yet waited for)."""
        tokenizer, backend_name, kv_on_update, dtype, device, engine_options, rank, daemon = self._child_args
        # not fork (it would copy this process's threads' locks mid-state): forks of a clean server
        # that imported torch once, so each child starts in a fraction of a spawn's time
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, name="asyncrl-rollout", daemon=daemon, args=(
            child_conn, self.weights.child_model, tokenizer, self.weights.child_views, backend_name, version,
            kv_on_update, dtype, device, engine_options, self.weights.address, rank, self.log_path))
        process.start()
        child_conn.close()  # the child holds the only other end: its death reads as EOF here
        child = _Child(process, conn, generation, self.name, self.log_path)
        child.joining = child.register(-2) if self.weights.address is not None else None
        child.ready = child.register(-1)
        threading.Thread(target=child.receive, name="asyncrl-rollout-recv", daemon=True).start()
        return child

    def wait_joining(self, timeout: float) -> None:
        """Collective transport: return once the child is alive and joining the weight group."""
        if self._child.joining is not None:
            self._child.wait_start(self._child.joining, timeout, "join the weight group")

    def wait_ready(self, timeout: float) -> int:
        """Return the child's pid once its backend is built (else raise, naming the log)."""
        self.pid = self._child.wait_start(self._child.ready, timeout, "become ready")
        return self.pid

    @property
    def process(self):
        """The current child process (a restart replaces it)."""
        return self._child.process

    def is_alive(self) -> bool:
        return self._child.error is None and self._child.is_alive()

    @property
    def exitcode(self) -> Optional[int]:
        """The current child's exit code (None while it runs), read under its lock."""
        return self._child.exitcode

    # ---- calls ------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        prompts = [list(p) for p in prompt_token_ids]
        return self._with_restarts(lambda child: self._call(child, "generate", prompts, params))

    def notify_update(self, version: int) -> Callable[[], int]:
        """Tell the child to load the weights just written (and, collective, about to be sent);
        returns ``loaded()``, which waits for its ack, sets ``version`` and returns it. A child
        that dies meanwhile is replaced by one started on these weights: ``loaded()`` still
        returns (past ``max_restarts`` it raises)."""
        while True:  # a child that died before reading "update" is replaced, the update re-sent
            child = self._child
            try:
                call_id = next(self._ids)
                future = child.register(call_id)
                child.send(call_id, "update", version)
                break
            except RolloutProcessDied as err:
                self._restart_after(child, err)

        def loaded() -> int:
            try:
                self.version = child.wait(future, self.hang_timeout_s, f"{self.name} to load version {version}")
            except RolloutProcessDied as err:
                # its replacement was started after the weights were written: it holds them
                self._restart_after(child, err)
            return self.version
        return loaded

    def run_probe(self, probe, version: int):
        """Run the weight-sync probe in the child: its engine's sampled log-probs vs an HF forward
        over the shared tensors (exactly the weights of the last push, until the next one)
        recomputes their log-probs, off the trainer's process. Raises ``WeightSyncError`` as
        ``probe.check`` does. Callers must not push while it runs (``WeightSync`` waits)."""
        def call(child: _Child):
            first = id(probe) not in child.probes_sent  # a restarted child has not seen it yet
            child.probes_sent.add(id(probe))
            return self._call(child, "probe", id(probe), probe if first else None, version)
        return self._with_restarts(call)

    def engine_metrics(self) -> dict:
        """The child backend's ``metrics`` (engine counters: KV blocks, preemptions, ...)."""
        return self._with_restarts(lambda child: self._call(child, "metrics"))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (after its running calls end); kill it if it does not stop in time
        (at once if it never became ready: it is not reading its pipe)."""
        self.closing = True
        child = self._child
        if child.is_alive() and self.pid is not None:
            stop_id = next(self._ids)
            try:
                stopped = child.register(stop_id)
                child.send(stop_id, "stop")
                stopped.result(timeout)  # answered after its workers and weight channel closed
                self.stopped_cleanly = True
            except (RolloutProcessError, TimeoutError):
                pass
            child.join(timeout)
        if child.is_alive():
            child.process.kill()
            child.join(timeout)
        child.conn.close()

    # ---- restarts ----------------------------------------------------------------------------
    def _with_restarts(self, call: Callable[[_Child], object]):
        """``call(child)``; if that child died under it, replace it (once per death, whichever
        thread sees it first) and call again on the new child."""
        return call_with_restarts(lambda: self._child, call, self._restart_after)

    def _restart_after(self, dead: _Child, error: RolloutProcessError) -> None:
        """Replace ``dead`` (a no-op if another thread already did); past ``max_restarts`` (or
        when the weight group cannot take a new member) the death is raised."""
        with self.weights.lock:  # no write in progress: the new child starts from a whole set
            if self._child is not dead:
                return
            if self.closing:
                raise error
            if self.restarts >= self.max_restarts:
                raise RolloutProcessError(f"{self.name} died and runtime.max_restarts={self.max_restarts} "
                                          f"restarts are used up: {error}") from error
            if not self.weights.can_replace_member:
                raise RolloutProcessError(f"{self.name} died and cannot be restarted: the collective weight "
                                          f"group of {self.weights.members} replicas cannot take a new member "
                                          f"(runtime.weight_transport=shared can): {error}") from error
            self.restarts += 1
            dead.join(1.0)
            if dead.is_alive():  # unresponsive enough to count as dead: make sure it is
                dead.process.kill()
                dead.join(5.0)
            dead.conn.close()
            if self.weights.address is not None:
                self.weights.rendezvous()  # a new group of the trainer and the new child
            version = self.weights.announced
            self._child = self._launch(version, dead.generation + 1)
            self.wait_joining(self.start_timeout_s)
            self.weights.connect(version)
            self.wait_ready(self.start_timeout_s)
            self.version = version
        if self.on_restart is not None:
            self.on_restart(self.restarts, str(error).splitlines()[0])

    # ---- calls over the pipe ----------------------------------------------------------------
    def _call(self, child: _Child, method: str, *args):
        call_id = next(self._ids)
        future = child.register(call_id)
        child.send(call_id, method, *args)
        return child.wait(future, self.hang_timeout_s, f"{self.name} to answer '{method}'")


class ProcessRolloutBackend(RolloutProcess):
    """``RolloutBackend`` whose generation runs in one child process with its own weights
    (``runtime.rollout_process``; see module doc). ``version`` changes only after the child
    confirmed the new weights."""

    def __init__(self, model: torch.nn.Module, tokenizer, backend_name: str = "engine", version: int = 0,
                 kv_on_update: str = "keep", dtype: Optional[torch.dtype] = None,
                 engine_options: Optional[dict] = None, device: Optional[str] = None, transport: str = "shared",
                 max_restarts: int = 0, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 on_restart: Optional[Callable[[int, str], None]] = None):
        """``device``: where the child generates (null: the trainer's device); ``transport``:
        ``shared`` (shared memory / CUDA IPC) or ``collective`` (broadcast, see module doc);
        ``max_restarts``: children that may die and be replaced; ``hang_timeout_s``: the
        longest wait for any answer; ``on_restart(restarts, reason)`` is told of each restart."""
        device = device or str(next(model.parameters()).device)
        self.transport = transport
        self.weights = TrainerWeights(model, transport, device, version=version, hang_timeout_s=hang_timeout_s,
                                      max_restarts=max_restarts)
        super().__init__(self.weights, tokenizer, backend_name, version, kv_on_update, dtype, engine_options, device,
                         max_restarts=max_restarts, hang_timeout_s=hang_timeout_s, on_restart=on_restart)
        self.shared = self.weights.views
        self.wait_joining(START_TIMEOUT_S)  # the child is alive and joining: join too
        self.weights.connect(version)
        self.wait_ready(START_TIMEOUT_S)

    @property
    def bytes_moved(self) -> int:
        """Weight bytes sent to the child so far (``TrainerWeights.bytes_moved``): by the
        broadcast channel (collective transport; each child's initial full broadcast included)
        or as the copies into the shared tensors (shared transport)."""
        return self.weights.bytes_moved

    # ---- the RolloutBackend protocol ------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.start_update(named_tensors, version)()

    def start_update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Callable[[], int]:
        """Copy the tensors into shared memory and tell the child; returns ``loaded()``, which
        waits for the child's ack, sets ``version`` and returns it. The caller must call it
        before the next ``start_update`` (which overwrites the shared tensors). A child that
        dies meanwhile is replaced by one started on these weights: ``loaded()`` still returns."""
        self.weights.write(named_tensors, version)
        loaded = self.notify_update(version)
        # collective: queued after the copies (NCCL waits for the current stream); the child
        # enters the same broadcast when it reads "update"
        channel, works = self.weights.channel, self.weights.send(version)

        def done() -> int:
            version_loaded = loaded()  # first: a dead child fails here, not in wait()
            if self.weights.channel is channel:  # else a restart formed a new group: these works are void
                for work in works:
                    work.wait()
            return version_loaded
        return done

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        self.weights.close()


def _child_main(conn, model, tokenizer, shared: Optional[dict], backend_name: str, version: int,
                kv_on_update: str, dtype, device: str, engine_options: dict,
                address: Optional[ChannelAddress], rank: int = 1, log_path: Optional[str] = None) -> None:
    """The rollout process: build the backend, then serve calls until "stop" or EOF.

    ``model``'s parameters are the shared tensors (or, with a channel ``address``, views into
    the buffers each broadcast fills; this process is ``rank`` of that group): it stays here as
    the probe's reference (always the weights of the last push); ``shared`` (those tensors by
    name) is not read here: a load hands the backend what a sync moves, from ``model``. Answers are (call id, ok,
    result | (error type name, traceback)); a failure to start is reported with call id None."""
    # Ctrl-C reaches the whole process group and a scheduler's SIGTERM may too: the trainer
    # decides when this process stops (it sends "stop", or its death closes the pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if log_path is not None:
        redirect_output(log_path)
    torch.set_num_threads(1)  # one core's worth: the trainer process has the other
    on_gpu = torch.device(device).type == "cuda" and torch.device(device).index is not None
    if on_gpu:  # CUDA graphs, streams, Triton and NCCL use the current device: the rollout GPU
        torch.cuda.set_device(torch.device(device))  # (per thread: the workers below set it too)
    send_lock = threading.Lock()

    def send(*message):
        with send_lock:
            conn.send(message)

    def answer(call_id, fn, *args):
        try:
            send(call_id, True, fn(*args))
        except BaseException as err:
            send(call_id, False, (type(err).__name__, traceback.format_exc()))

    channel = flat = None
    try:
        if address is not None:
            send(-2, True, None)  # the trainer joins the group once it reads this
            channel = WeightChannel.join(address, rank)
            full = FlatWeights(FlatWeights.specs_of(model.named_parameters()), device)
            channel.receive(full, version)
            # what each push broadcasts: everything, or a LoRA model's adapters (their own buffers)
            flat = FlatWeights(FlatWeights.specs_of(sync_tensors(model)), device) if is_lora(model) else full
            if flat is not full:
                flat.copy_from((name, full.views[name]) for name in flat.views)
            model = attach_weights(model, {**full.views, **flat.views}, device)
        server = ReplicaServer(model, tokenizer, backend_name, version, kv_on_update, dtype, device, engine_options)
        send(-1, True, _os_pid())
    except BaseException:
        send(None, False, traceback.format_exc())
        raise SystemExit(1)

    def load(v: int) -> int:
        if channel is not None:
            channel.receive(flat, v)
        return server.load(v)  # the module's parameters are the received (or shared) tensors
    calls = {"generate": server.generate, "probe": server.probe}
    # rollout workers + the probe; each new thread's current device is cuda:0 unless set
    workers = ThreadPoolExecutor(4, thread_name_prefix="asyncrl-rollout-gen",
                                 initializer=torch.cuda.set_device if on_gpu else None,
                                 initargs=(torch.device(device),) if on_gpu else ())
    stop_id = None
    while True:
        try:
            call_id, method, *args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            break
        if method == "stop":
            stop_id = call_id
            break
        if method == "update":  # here, not in a worker: between two engine steps, while generations run
            answer(call_id, load, *args)
        elif method == "metrics":  # counters only: answered at once, even while every worker generates
            answer(call_id, server.metrics)
        else:
            workers.submit(answer, call_id, calls[method], *args)
    workers.shutdown(wait=True)
    if channel is not None:
        channel.close()
    if stop_id is not None:
        try:
            send(stop_id, True, None)
        except (OSError, ValueError):  # the trainer stopped waiting
            pass


def _child_error(name: str, trace: str) -> Exception:
    """The exception a failed call raises in the trainer: a failed probe stays a
    ``WeightSyncError``; anything else is a ``RolloutProcessError`` with the child's traceback."""
    from asyncrl.runtime.weight_sync import WeightSyncError

    if name == "WeightSyncError":
        return WeightSyncError(f"(probed in the rollout process)\n{trace}")
    return RolloutProcessError(f"in the rollout process:\n{trace}")


def _os_pid() -> int:
    return os.getpid()
