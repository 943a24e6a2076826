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
    limit the death is raised.
"""
from __future__ import annotations

import itertools
import signal
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import torch
import torch.multiprocessing as mp

from asyncrl.runtime.executors.weight_channel import (ChannelAddress, FlatWeights, WeightChannel, attach_weights,
                                                      channel_backend, host_store, weightless_clone)
from asyncrl.errors import AsyncRLError
from asyncrl.runtime.waits import DEFAULT_HANG_TIMEOUT_S, Deadline
from asyncrl.training.lora import is_lora, sync_tensors
from asyncrl.types import RequestOutput, SamplingParams

START_TIMEOUT_S = 300.0  # spawning imports torch and transformers; a busy machine is slow


class RolloutProcessError(AsyncRLError, RuntimeError):
    """The rollout process failed (its traceback is in the message) or died."""


class RolloutProcessDied(RolloutProcessError):
    """The rollout process is gone (killed, crashed): a restart can replace it."""


class _Child:
    """One rollout process and its side of the pipe: the calls waiting for its answers.

    Invariant: a failure of this child settles only this child's calls; a restart makes a new
    ``_Child``, so a late error of the dead one can never fail the calls of its replacement."""

    def __init__(self, process, conn, generation: int):
        self.process, self.conn, self.generation = process, conn, generation
        self.pending: dict[int, Future] = {}
        self.error: Optional[RolloutProcessError] = None
        self.probes_sent: set[int] = set()
        self.lock, self.send_lock = threading.Lock(), threading.Lock()

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
            raise self.fail(RolloutProcessDied(f"the rollout process is gone ({err!r}); {self.exit_note()}"))

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
        one that lives but does not answer is reported, and no wait outlasts ``timeout``."""
        deadline = Deadline(what, timeout, hint=f"the rollout process (pid {self.process.pid}) is alive but "
                                                "does not answer")
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self.process.is_alive():
                    raise self.fail(RolloutProcessDied(f"the rollout process died; {self.exit_note()}"))
                deadline.check()

    def receive(self) -> None:
        """Receiver thread: settle the future of each answer; on EOF fail them all."""
        while True:
            try:
                call_id, ok, payload = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(5.0)
                self.fail(RolloutProcessDied(f"the rollout process died; {self.exit_note()}"))
                return
            if call_id is None:  # fatal: the child reports its traceback, then exits
                self.fail(RolloutProcessError(f"the rollout process failed:\n{payload}"))
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
        return f"pid {self.process.pid}, exit code {self.process.exitcode}"


class ProcessRolloutBackend:
    """``RolloutBackend`` whose generation runs in a child process (see module doc).

    ``version`` changes only after the child confirmed the new weights."""

    def __init__(self, model: torch.nn.Module, tokenizer, backend_name: str = "engine", version: int = 0,
                 kv_on_update: str = "keep", dtype: Optional[torch.dtype] = None,
                 engine_options: Optional[dict] = None, device: Optional[str] = None, transport: str = "shared",
                 max_restarts: int = 0, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 on_restart: Optional[Callable[[int, str], None]] = None):
        """``device``: where the child generates (null: the trainer's device); ``transport``:
        ``shared`` (shared memory / CUDA IPC) or ``collective`` (broadcast, see module doc);
        ``max_restarts``: children that may die and be replaced; ``hang_timeout_s``: the
        longest wait for any answer; ``on_restart(restarts, reason)`` is told of each restart."""
        self.version, self.backend_name, self.transport = version, backend_name, transport
        self.inflight_weight_update = backend_name == "engine"  # the engine swaps weights between steps
        self.max_restarts, self.hang_timeout_s, self.on_restart = max_restarts, hang_timeout_s, on_restart
        self.restarts = 0
        self.closing = False  # set by close (or the controller): a child dying now is not replaced
        trainer_device = next(model.parameters()).device
        device = device or str(trainer_device)
        self._channel: Optional[WeightChannel] = None
        self._cuda_shared = trainer_device.type == "cuda" and transport == "shared"
        self._shared_bytes = 0  # shared transport: weight bytes the pushes copied into the shared tensors
        self._moved_by_closed_channels = 0  # collective transport: the channels of children that died
        if transport == "collective":
            # the trainer's send buffer ([name] -> view); the child gets the module without weights.
            # A child starts from all the weights (``self._full``); each push then broadcasts what a
            # sync moves (``self._flat``: everything, or a LoRA model's adapters A and B)
            self._channel_kind = channel_backend(trainer_device, torch.device(device))
            self._full = FlatWeights(FlatWeights.specs_of(model.named_parameters()), trainer_device)
            self._full.copy_from(model.named_parameters())
            self._flat = (FlatWeights(FlatWeights.specs_of(sync_tensors(model)), trainer_device) if is_lora(model)
                          else self._full)
            if self._flat is not self._full:
                self._flat.copy_from((name, self._full.views[name]) for name in self._flat.views)
            self.shared, self._child_model = self._flat.views, weightless_clone(model)
        else:
            self._child_model = self._shared_reference(model)
        self._child_args = (tokenizer, backend_name, kv_on_update, dtype, device, engine_options or {})
        self._ids = itertools.count()
        self._restart_lock = threading.Lock()
        self._announced = version  # the version the shared tensors hold (the last start_update's)
        self._child = self._spawn(version, generation=0)

    def _spawn(self, version: int, generation: int) -> _Child:
        """A child on the current shared tensors at ``version``, once it serves calls."""
        store = address = None
        if self.transport == "collective":
            store, address = host_store(self._channel_kind, self.hang_timeout_s)
        tokenizer, backend_name, kv_on_update, dtype, device, engine_options = self._child_args
        ctx = mp.get_context("spawn")  # fork would copy this process's threads' locks mid-state
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, name="asyncrl-rollout", daemon=True, args=(
            child_conn, self._child_model, tokenizer, backend_name, version, kv_on_update, dtype, device,
            engine_options, address))
        process.start()
        child_conn.close()  # the child holds the only other end: its death reads as EOF here
        child = _Child(process, conn, generation)
        joining = child.register(-2) if address is not None else None
        ready = child.register(-1)
        threading.Thread(target=child.receive, name="asyncrl-rollout-recv", daemon=True).start()
        if address is not None:
            child.wait(joining, START_TIMEOUT_S, "the rollout process to start")  # alive and joining: join too
            self._channel = WeightChannel(store, address, rank=0)
            if self._flat is not self._full:  # LoRA: the frozen base and the last pushed adapters
                self._full.copy_from(self._flat.views.items())
            for work in self._channel.broadcast(self._full, version):  # all the weights, once per child
                work.wait()
        self.pid = child.wait(ready, START_TIMEOUT_S, "the rollout process to start")
        self.version = version
        if self.transport == "collective" and self._flat is not self._full and self.max_restarts == 0:
            self._full = None  # LoRA, no restart possible: the frozen base never moves again
        return child

    @property
    def process(self):
        """The current child process (a restart replaces it)."""
        return self._child.process

    @property
    def bytes_moved(self) -> int:
        """Weight bytes sent to the child so far, counted where they move: by the broadcast
        channel (collective transport; the initial full broadcast included) or as the copies into
        the shared tensors (shared transport). A LoRA push moves the adapters only; a restarted
        child gets all the weights again (counted too)."""
        if self.transport != "collective":
            return self._shared_bytes
        return self._moved_by_closed_channels + (self._channel.bytes_moved if self._channel is not None else 0)

    def _shared_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A module whose parameters are shared with the child (``self.shared``: [name] ->
        tensor, written by each push); the child builds its backend from it and keeps it as the
        probe's reference. CPU: shared memory. CUDA: stays on the trainer's GPU (CUDA IPC).
        A LoRA model's frozen base is the trainer's own tensors (never written): only the
        adapters are copies."""
        from asyncrl.runtime.weight_sync import clone_for_rollout

        reference = clone_for_rollout(model, share_frozen=True)
        if not self._cuda_shared:
            reference = reference.cpu()
        self.shared = {n: p.data if self._cuda_shared else p.data.share_memory_()
                       for n, p in reference.named_parameters()}
        return reference

    # ---- the RolloutBackend protocol ------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        prompts = [list(p) for p in prompt_token_ids]
        return self._with_restarts(lambda child: self._call(child, "generate", prompts, params))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.start_update(named_tensors, version)()

    def start_update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Callable[[], int]:
        """Copy the tensors into shared memory and tell the child; returns ``loaded()``, which
        waits for the child's ack, sets ``version`` and returns it. The caller must call it
        before the next ``start_update`` (which overwrites the shared tensors). A child that
        dies meanwhile is replaced by one started on these weights: ``loaded()`` still returns."""
        # under the restart lock: a child is never started from half-copied tensors, and one
        # started after this block starts from these weights at this version
        with self._restart_lock, torch.no_grad():
            for name, tensor in named_tensors:
                self.shared[name].copy_(tensor.detach())
                self._shared_bytes += tensor.numel() * tensor.element_size()
            if self._cuda_shared:  # the child reads them from its own stream: the copies must be done
                torch.cuda.synchronize(next(iter(self.shared.values())).device)
            self._announced = version
        while True:  # a child that died before reading "update" is replaced, the update re-sent
            child = self._child
            try:
                call_id = next(self._ids)
                future = child.register(call_id)
                child.send(call_id, "update", version)
                break
            except RolloutProcessDied as err:
                self._restart_after(child, err)
        # collective: queued after the copies (NCCL waits for the current stream); the child
        # enters the same broadcast when it reads "update"
        works = self._channel.broadcast(self._flat, version) if self._channel is not None else []

        def loaded() -> int:
            try:  # first: a dead child fails here, not in wait()
                self.version = child.wait(future, self.hang_timeout_s, f"the rollout process to load version {version}")
            except RolloutProcessDied as err:
                # its replacement was started after the copy above: it holds these weights
                self._restart_after(child, err)
                return self.version
            for work in works:
                work.wait()
            return self.version
        return loaded

    def run_probe(self, probe, version: int):
        """``probe.check`` run in the child: its engine samples the probe tokens and an HF forward
        over the shared tensors (exactly the weights of the last push, until the next one)
        recomputes their log-probs, off the trainer's process. Raises ``WeightSyncError`` as
        ``probe.check`` does. Callers must not push while it runs (``WeightSync`` waits)."""
        def call(child: _Child):
            first = id(probe) not in child.probes_sent  # a restarted child has not seen it yet
            child.probes_sent.add(id(probe))
            return self._call(child, "probe", id(probe), probe if first else None, version)
        return self._with_restarts(call)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (after its running calls end); kill it if it does not stop in time."""
        self.closing = True
        child = self._child
        if child.process.is_alive():
            try:
                child.send(next(self._ids), "stop")
            except RolloutProcessError:
                pass
            child.process.join(timeout)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout)
        child.conn.close()
        if self._channel is not None:
            self._channel.close()

    # ---- restarts ----------------------------------------------------------------------------
    def _with_restarts(self, call: Callable[[_Child], object]):
        """``call(child)``; if that child died under it, replace it (once per death, whichever
        thread sees it first) and call again on the new child."""
        while True:
            child = self._child
            try:
                return call(child)
            except RolloutProcessDied as err:
                self._restart_after(child, err)

    def _restart_after(self, dead: _Child, error: RolloutProcessError) -> None:
        """Replace ``dead`` (a no-op if another thread already did); past ``max_restarts`` the
        death is raised."""
        with self._restart_lock:
            if self._child is not dead:
                return
            if self.closing:
                raise error
            if self.restarts >= self.max_restarts:
                raise RolloutProcessError(f"the rollout process died and runtime.max_restarts={self.max_restarts} "
                                          f"restarts are used up: {error}") from error
            self.restarts += 1
            dead.process.join(1.0)
            if dead.process.is_alive():  # unresponsive enough to count as dead: make sure it is
                dead.process.kill()
                dead.process.join(5.0)
            dead.conn.close()
            if self._channel is not None:
                self._moved_by_closed_channels += self._channel.bytes_moved
                self._channel.close()
                self._channel = None
            self._child = self._spawn(self._announced, dead.generation + 1)
        if self.on_restart is not None:
            self.on_restart(self.restarts, str(error).splitlines()[0])

    # ---- calls over the pipe ----------------------------------------------------------------
    def _call(self, child: _Child, method: str, *args):
        call_id = next(self._ids)
        future = child.register(call_id)
        child.send(call_id, method, *args)
        return child.wait(future, self.hang_timeout_s, f"the rollout process to answer '{method}'")



def _child_main(conn, model, tokenizer, backend_name: str, version: int,
                kv_on_update: str, dtype, device: str, engine_options: dict,
                address: Optional[ChannelAddress]) -> None:
    """The rollout process: build the backend, then serve calls until "stop" or EOF.

    ``model``'s parameters are the shared tensors (or, with a channel ``address``, views into
    the buffers each broadcast fills): it stays here as the probe's reference (always the
    weights of the last push). Answers are (call id, ok, result | (error type name,
    traceback)); a failure to start is reported with call id None."""
    # Ctrl-C reaches the whole process group and a scheduler's SIGTERM may too: the trainer
    # decides when this process stops (it sends "stop", or its death closes the pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
            channel = WeightChannel.join(address)
            full = FlatWeights(FlatWeights.specs_of(model.named_parameters()), device)
            channel.receive(full, version)
            # what each push broadcasts: everything, or a LoRA model's adapters (their own buffers)
            flat = FlatWeights(FlatWeights.specs_of(sync_tensors(model)), device) if is_lora(model) else full
            if flat is not full:
                flat.copy_from((name, full.views[name]) for name in flat.views)
            model = attach_weights(model, {**full.views, **flat.views}, device)
        backend = _build_child_backend(model, tokenizer, backend_name, version, kv_on_update, dtype, device,
                                       engine_options)
        send(-1, True, _os_pid())
    except BaseException:
        send(None, False, traceback.format_exc())
        raise SystemExit(1)

    from asyncrl.runtime.weight_sync import rollout_weights

    def load(v: int) -> int:
        if channel is not None:
            channel.receive(flat, v)
        # the module's parameters are the received tensors: all of them, the adapters (LoRA), or
        # the merged weights computed here from the base and the adapters (an engine that merged)
        backend.update_weights(rollout_weights(model, backend), v)
        return backend.version
    probes: dict = {}  # the trainer's probe objects by key (each keeps its last result for delta)
    calls = {"generate": backend.generate,
             "probe": lambda key, probe, v: probes.setdefault(key, probe).check(backend, model, v)}
    # rollout workers + the probe; each new thread's current device is cuda:0 unless set
    workers = ThreadPoolExecutor(4, thread_name_prefix="asyncrl-rollout-gen",
                                 initializer=torch.cuda.set_device if on_gpu else None,
                                 initargs=(torch.device(device),) if on_gpu else ())
    while True:
        try:
            call_id, method, *args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            break
        if method == "stop":
            break
        if method == "update":  # here, not in a worker: between two engine steps, while generations run
            answer(call_id, load, *args)
        else:
            workers.submit(answer, call_id, calls[method], *args)
    workers.shutdown(wait=True)
    if channel is not None:
        channel.close()


def _child_error(name: str, trace: str) -> Exception:
    """The exception a failed call raises in the trainer: a failed probe stays a
    ``WeightSyncError``; anything else is a ``RolloutProcessError`` with the child's traceback."""
    from asyncrl.runtime.weight_sync import WeightSyncError

    if name == "WeightSyncError":
        return WeightSyncError(f"(probed in the rollout process)\n{trace}")
    return RolloutProcessError(f"in the rollout process:\n{trace}")


def _build_child_backend(model, tokenizer, backend_name, version, kv_on_update, dtype, device, engine_options):
    """The backend owns a copy: the engine copies ``model``'s (shared) tensors into its own
    layout; HF generate gets a private clone, so a push never lands inside a ``generate``."""
    if backend_name == "engine":  # the engine copies the shared tensors onto ``device``; ``model``
        from asyncrl.rollout.engine_backend import EngineBackend  # stays shared (the probe reads it)

        return EngineBackend(model, tokenizer, version=version, dtype=dtype, device=device, kv_on_update=kv_on_update,
                             **engine_options)
    from asyncrl.rollout.hf import HFGenerateBackend
    from asyncrl.runtime.weight_sync import clone_for_rollout

    return HFGenerateBackend(clone_for_rollout(model).to(device), tokenizer, version)


def _os_pid() -> int:
    import os

    return os.getpid()
