"""Engine replicas as Ray actors (``runtime.executor=ray`` with ``rollout.engines`` > 1 or
``rollout.tensor_parallel_size`` > 1): the second launcher of the fleet, beside the local
processes of ``replicas.py``. The router, weight versions, probe, metrics and failover are
``rollout/fleet.py``'s, the replica's side is ``replica_server.py``'s: only where a replica
runs and how its calls and weights travel differ.

    placement group (rollout.ray_strategy: PACK | SPREAD): engines x [{CPU: 1, GPU: tp}]
        a bundle never spans nodes, so a replica's TP ranks share a node (STRICT_PACK within a
        replica); PACK fills a node before the next, SPREAD puts replicas on different nodes
    replica i: a ReplicaActor in bundle i; Ray shows it its bundle's GPUs only, so its engine
        runs on cuda:0 and spawns its TP ranks on cuda:1..tp-1; its stdout/stderr go to
        <log_dir>/replica<i>.log on its node
    weights: each push is copied to CPU once and put in Ray's object store (``ray.put``); every
        replica gets the same object, which Ray moves once per node (zero-copy between the
        actors of one node), and copies it into its reference module, then its engine

Why the object store and not the broadcast channel (``weight_channel.py``): the channel's store
listens on 127.0.0.1 and its group cannot drop a member, while a multi-node cluster has no
shared /dev/shm (no shared tensors either), and a replica actor that dies must leave the run
going. The object store reaches every node and has no membership. The cost is one device-to-host
copy per push and a host-to-device copy per replica.

Everything that can be checked is checked before a model moves: the TP split, and replicas x
TP against the Ray cluster's GPUs (in total, and TP GPUs on one node). A placement group that
is not placed, or a replica that is not ready, within ``start_timeout_s`` is named (with the
replica's node and log), and the actors are stopped.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from asyncrl.errors import HangError
from asyncrl.rollout.fleet import Fleet
from asyncrl.runtime.executors.process import RolloutProcessDied, RolloutProcessError, call_with_restarts
from asyncrl.runtime.executors.ray_cluster import check_cluster_cpus, check_cluster_gpus
from asyncrl.runtime.executors.replica_server import ReplicaServer, redirect_output
from asyncrl.runtime.executors.replicas import (FleetConfigError, check_fleet_splits, named_restarts,
                                                replica_engine_options)
from asyncrl.runtime.executors.weight_channel import attach_weights, weightless_clone
from asyncrl.runtime.waits import DEFAULT_HANG_TIMEOUT_S

MAX_CONCURRENT_CALLS = 16  # generate calls of every rollout worker + a load, a probe and metrics at once


def to_array(tensor: torch.Tensor):
    """(numpy array, dtype name): Ray stores numpy arrays out of band and an actor reads them in
    place from its node's shared memory (a pickled tensor would be copied at both ends, ~10x
    slower per push on the CPU). bf16/fp8 have no numpy dtype: their bits travel as integers."""
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.view(torch.int16).numpy(), str(tensor.dtype)
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
        return tensor.view(torch.uint8).numpy(), str(tensor.dtype)
    return tensor.numpy(), str(tensor.dtype)


def from_array(array, dtype: str) -> torch.Tensor:
    """The tensor ``to_array`` took apart (a read-only view of the object store's memory)."""
    import warnings

    with warnings.catch_warnings():  # read-only: only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(getattr(torch, dtype.removeprefix("torch.")))


class ObjectStoreWeights:
    """The weights every replica actor loads: the last push, put once in Ray's object store.

    Invariant: ``ref`` holds the weights of the last ``write`` (stamped ``announced``); each
    replica's load gets that object. Also owns the fleet's placement group (removed by
    ``close``, after the fleet closed its replicas)."""

    def __init__(self, model: torch.nn.Module, placement_group):
        import ray

        self.placement_group, self.lock, self.announced = placement_group, threading.Lock(), 0
        self.module = ray.put(weightless_clone(model))  # what a replica builds its reference from
        self.bytes_moved = 0
        self.ref = None
        self.write(model.named_parameters(), 0)

    @torch.no_grad()
    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Optional[int] = None) -> None:
        """One copy into the object store (``ray.put`` copies at once: the trainer may go on)."""
        import ray

        state = {name: to_array(tensor) for name, tensor in named_tensors}
        with self.lock:
            self.ref = ray.put(state)
            self.bytes_moved += sum(array.nbytes for array, _ in state.values())
            if version is not None:
                self.announced = version

    def send(self, version: int) -> list:
        """Nothing to start: each replica's load fetches ``ref``."""
        return []

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.ref = None
        remove_placement_group(self.placement_group)


class ReplicaActor:
    """The Ray actor of one replica: a :class:`ReplicaServer` (threaded: several generate calls,
    a load between two engine steps, metrics at once)."""

    def __init__(self, log_path: Optional[str]):
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            redirect_output(log_path)
        self.server: Optional[ReplicaServer] = None

    def where(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def start(self, module, state: dict, tokenizer, backend_name: str, version: int, kv_on_update: str, dtype,
              engine_options: dict, on_gpu: bool) -> int:
        """Build the backend on this actor's device (Ray shows it only its bundle's GPUs)."""
        device = "cuda:0" if on_gpu else "cpu"
        if on_gpu:
            torch.cuda.set_device(0)
        model = attach_weights(module, {name: from_array(*pair).to(device, copy=True) for name, pair in state.items()},
                               device)
        self.server = ReplicaServer(model, tokenizer, backend_name, version, kv_on_update, dtype, device,
                                    engine_options)
        return os.getpid()

    def generate(self, prompt_token_ids, params):
        return self.server.generate(prompt_token_ids, params)

    @torch.no_grad()
    def load(self, state: dict, version: int) -> int:
        params = dict(self.server.model.named_parameters())
        for name, pair in state.items():
            params[name].copy_(from_array(*pair))
        return self.server.load(version)

    def probe(self, key, probe, version: int):
        return self.server.probe(key, probe, version)

    def metrics(self) -> dict:
        return self.server.metrics()


class RayReplica:
    """The trainer's side of one replica actor: the replica interface ``Fleet`` calls (the same
    as ``RolloutProcess``'s). An actor that died (``RayActorError``) is replaced, up to
    ``max_restarts`` times, by a new actor in the same bundle started from the last written
    weights (``launch(ref, version)``), and the call that saw the death is sent again: a
    ``generate`` in flight returns normally, its groups keep their ids. Past the limit its calls
    raise :class:`RolloutProcessDied` naming its node and log, ``is_alive`` is False, and the
    fleet removes it and generates its groups elsewhere. No wait outlasts ``hang_timeout_s``.

    Invariant: ``actor`` is the current actor; a death is acted on once (the first thread to
    see it relaunches; a late error of a replaced actor never marks its successor dead)."""

    def __init__(self, actor, weights: ObjectStoreWeights, name: str, where: str, log_path: str, backend_name: str,
                 version: int = 0, hang_timeout_s: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
                 launch: Optional[Callable[[object, int], object]] = None, max_restarts: int = 0,
                 on_restart: Optional[Callable[[int, str], None]] = None):
        self.actor, self.weights, self.name, self.where, self.log_path = actor, weights, name, where, log_path
        self.version, self.hang_timeout_s = version, hang_timeout_s
        self.inflight_weight_update = backend_name == "engine"  # the engine swaps weights between steps
        self.launch, self.max_restarts, self.on_restart = launch, max_restarts, on_restart
        self.restarts, self.closing = 0, False
        self._dead: Optional[BaseException] = None  # why the current actor is gone (restarts used up)
        self._probes_sent: set[int] = set()

    def is_alive(self) -> bool:
        return self._dead is None

    def generate(self, prompt_token_ids, params):
        prompts = [list(p) for p in prompt_token_ids]
        return self._with_restarts(lambda actor: self._get(actor, actor.generate.remote(prompts, params), "generate"))

    def notify_update(self, version: int) -> Callable[[], int]:
        """Tell the actor to load the last written weights; ``loaded()`` waits for its ack (an
        actor that dies meanwhile is replaced by one started on these weights)."""
        actor = self.actor
        ref = actor.load.remote(self.weights.ref, version)

        def loaded() -> int:
            try:
                self.version = self._get(actor, ref, f"load version {version}")
            except RolloutProcessDied as err:
                self._restart_after(actor, err)
            return self.version
        return loaded

    def run_probe(self, probe, version: int):
        def call(actor):
            first = (id(actor), id(probe)) not in self._probes_sent  # sent once per actor, then only its key
            self._probes_sent.add((id(actor), id(probe)))
            return self._get(actor, actor.probe.remote(id(probe), probe if first else None, version), "probe")
        return self._with_restarts(call)

    def engine_metrics(self) -> dict:
        return self._with_restarts(lambda actor: self._get(actor, actor.metrics.remote(), "metrics"))

    def close(self, timeout: float = 30.0) -> None:
        import ray

        self.closing = True
        ray.kill(self.actor, no_restart=True)

    # ---- restarts ----------------------------------------------------------------------------
    def _with_restarts(self, call: Callable[[object], object]):
        return call_with_restarts(lambda: self.actor, call, self._restart_after)

    def _restart_after(self, dead, error: RolloutProcessDied) -> None:
        """Replace ``dead`` (a no-op if done already); past ``max_restarts`` the replica is gone."""
        import ray

        with self.weights.lock:  # no write in progress: the new actor starts from a whole set
            if self.actor is not dead:
                return
            if self.closing or self.launch is None or self.restarts >= self.max_restarts:
                self._dead = self._dead or error
                raise error
            self.restarts += 1
            ray.kill(dead, no_restart=True)  # frees its bundle for the new actor
            version = self.weights.announced
            self.actor = self.launch(self.weights.ref, version)
            self.version = version
        if self.on_restart is not None:
            self.on_restart(self.restarts, str(error).splitlines()[0])

    def _get(self, actor, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._dead is not None:
            raise RolloutProcessDied(f"{self.name} is gone ({self._dead_note(self._dead)})")
        try:
            return ray.get(ref, timeout=self.hang_timeout_s)
        except GetTimeoutError:
            raise HangError(f"{self.name} did not answer '{what}' in {self.hang_timeout_s:g} s; it is alive "
                            f"({self.where}); its log: {self.log_path} (runtime.hang_timeout_s)") from None
        except RayActorError as err:
            raise RolloutProcessDied(f"{self.name} died ({self._dead_note(err)})") from err

    def _dead_note(self, err: BaseException) -> str:
        cause = str(err).strip().splitlines()[0]
        return f"Ray actor on {self.where}: {cause}; its log: {self.log_path}"


def start_ray_fleet(model: torch.nn.Module, tokenizer, backend_name: str, *, engines: int, tensor_parallel_size: int,
                    on_gpu: bool, strategy: str = "PACK", kv_on_update: str = "keep",
                    dtype: Optional[torch.dtype] = None, engine_options: Optional[dict] = None,
                    log_dir: Optional[Path] = None, start_timeout_s: float = 300.0,
                    on_lost: Optional[Callable[[str], None]] = None,
                    hang_timeout_s: Optional[float] = DEFAULT_HANG_TIMEOUT_S, max_restarts: int = 0,
                    on_restart: Optional[Callable[[int, str], None]] = None) -> Fleet:
    """Place the replicas (see module doc), start every actor at once, wait until each is
    ready; Ray must be initialized (``ray_cluster.init_ray``). A replica actor that dies is replaced up
    to ``max_restarts`` times (``on_restart(restarts, reason)``, the replica named in ``reason``)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_fleet_splits(model, backend_name, tensor_parallel_size)
    check_cluster_cpus(engines)
    if on_gpu:
        check_cluster_gpus(engines, tensor_parallel_size)
    log_dir = Path(log_dir) if log_dir is not None else Path(os.environ.get("TMPDIR", "/tmp"), "asyncrl-rollout")
    bundle = {"CPU": 1, "GPU": tensor_parallel_size} if on_gpu else {"CPU": 1}
    group = placement_group([bundle] * engines, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise FleetConfigError(f"the Ray cluster did not place {engines} replica(s) of {bundle} ({strategy}) within "
                               f"{start_timeout_s:g}s; free now: {ray.available_resources()}") from None
    weights = ObjectStoreWeights(model, group)
    names = [f"rollout replica {i}" for i in range(engines)]
    logs = [str(log_dir / f"replica{i}.log") for i in range(engines)]

    def create(i: int):
        return ray.remote(ReplicaActor).options(
            num_cpus=1, num_gpus=tensor_parallel_size if on_gpu else 0, max_concurrency=MAX_CONCURRENT_CALLS,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote(logs[i])

    def start(i: int, actor, ref, version: int):
        return actor.start.remote(weights.module, ref, tokenizer, backend_name, version, kv_on_update, dtype,
                                  replica_engine_options(engine_options, tensor_parallel_size, backend_name, i), on_gpu)

    def launcher(i: int):
        def launch(ref, version: int):  # a new actor in bundle i, ready (or named)
            actor = create(i)
            try:
                _wait_ready([start(i, actor, ref, version)], names[i:i + 1], where[i:i + 1], logs[i:i + 1],
                            start_timeout_s)
            except BaseException:
                ray.kill(actor, no_restart=True)
                raise
            return actor
        return launch

    actors = [create(i) for i in range(engines)]
    starts = [start(i, actor, weights.ref, 0) for i, actor in enumerate(actors)]
    where = [f"node {ip}" for ip in _bundle_nodes(group, engines)]
    try:
        _wait_ready(starts, names, where, logs, start_timeout_s)
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        weights.close()
        raise
    replicas = [RayReplica(actor, weights, names[i], where[i], logs[i], backend_name, hang_timeout_s=hang_timeout_s,
                           launch=launcher(i), max_restarts=max_restarts,
                           on_restart=named_restarts(on_restart, names[i]))
                for i, actor in enumerate(actors)]
    return Fleet(replicas, weights, on_lost=on_lost)


def _bundle_nodes(group, engines: int) -> list[str]:
    """The address of the node each bundle was placed on."""
    import ray
    from ray.util.placement_group import placement_group_table

    nodes = placement_group_table(group).get("bundles_to_node_id", {})
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [address.get(nodes.get(i), "?") for i in range(engines)]


def _wait_ready(starts: list, names: list[str], where: list[str], logs: list[str], timeout: float) -> None:
    """Each replica's start returned within ``timeout`` (all started together), else named."""
    import time

    import ray
    from ray.exceptions import GetTimeoutError, RayError

    deadline = time.monotonic() + timeout
    for start, name, node, log in zip(starts, names, where, logs):
        try:
            ray.get(start, timeout=max(deadline - time.monotonic(), 0.1))
        except GetTimeoutError:
            raise RolloutProcessError(f"{name} (Ray actor on {node}) did not become ready within {timeout:.0f}s; "
                                      f"its log: {log} on {node}") from None
        except RayError as err:
            raise RolloutProcessError(f"{name} (Ray actor on {node}) failed to start; its log: {log} on {node}:\n"
                                      f"{err}") from err
