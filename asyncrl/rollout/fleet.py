"""Fleet: N engine replicas behind one ``RolloutBackend``, with a router, weights to all, failover.

    RolloutLoop ─ generate(prompts) ─► Fleet ─ Router: group -> replica ─► replica 0 (engine, TP ranks)
    (one StalenessManager: admission      │                              ├► replica 1
     stays global)                        └─ the outputs, in prompt order
    WeightSync ─ start_update(v) ─► Fleet ─ weights written once ─► every replica loads v, acks;
                                    version = v once all acked; the probe runs on every replica

The async controller and the staleness manager talk to the fleet only: it is a ``RolloutBackend``
with ``version``, ``generate``, ``update_weights`` / ``start_update`` and ``run_probe``, so
admission, the buffer and weight sync work unchanged whatever the number of replicas.

Placement (``router.py``): each prompt of a call is one group, sent whole to one replica (its
engine forks the prompt's KV n ways); groups go to the replica with the fewest outstanding
tokens; ``session_ids`` keep a conversation's turns on one replica until ``end_session``.

Failure: a replica whose process dies is removed from the router; the groups it was generating
are generated again on the others inside the same call, so the caller gets exactly one complete
output per prompt: no group lost, none returned (so trained) twice, and each token keeps the
version of the replica that sampled it. The run goes on with fewer replicas; the loss is counted
in ``fleet/replicas_lost`` (a health event) and printed with the replica's exit code and log.

Versions: every push is written once and loaded by every live replica; ``version`` rises to v
only after all of them acknowledged v (``fleet/version_spread`` = 0 after every sync), so the
admission version never runs ahead of any replica. Replicas switch between two of their own
engine steps, so during a push a token sampled on one replica may carry v while another still
samples v − 1: each token's version names the weights that sampled it, on any replica.

Replicas are duck-typed (``runtime/executors/process.py: RolloutProcess``): ``generate``,
``notify_update(v) -> loaded()``, ``run_probe``, ``engine_metrics``, ``is_alive``, ``close``,
``name`` (and ``restarts``: each replica restarts a dead child up to ``runtime.max_restarts``
times before it counts as lost); ``weights`` (``TrainerWeights``): ``write(tensors, v)``,
``send(v) -> works``, ``close``.
"""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from asyncrl.metrics.members import member_key
from asyncrl.rollout.router import Router
from asyncrl.types import RequestOutput, SamplingParams


class FleetError(RuntimeError):
    """The fleet cannot go on (every replica is gone, or a loss it cannot absorb)."""


@dataclass
class ReplicaStats:
    """Counters of one replica since the start (busy = at least one call in flight)."""

    calls_in_flight: int = 0
    busy_since: float = 0.0
    busy_seconds: float = 0.0
    tokens: int = 0
    groups_in_flight: int = 0
    window: tuple = field(default_factory=lambda: (time.perf_counter(), 0.0, 0))  # (t, busy, tokens) at last read

    def start(self, groups: int) -> None:
        if self.calls_in_flight == 0:
            self.busy_since = time.perf_counter()
        self.calls_in_flight += 1
        self.groups_in_flight += groups

    def end(self, groups: int, tokens: int) -> None:
        self.calls_in_flight -= 1
        self.groups_in_flight -= groups
        self.tokens += tokens
        if self.calls_in_flight == 0:
            self.busy_seconds += time.perf_counter() - self.busy_since

    def busy_now(self, now: float) -> float:
        return self.busy_seconds + (now - self.busy_since if self.calls_in_flight else 0.0)


class Fleet:
    """``RolloutBackend`` over engine replicas (see module doc).

    Invariant: ``version`` is a version every live replica acknowledged, and each call to
    ``generate`` returns one output per prompt, each generated whole by one replica."""

    def __init__(self, replicas: Sequence, weights, version: int = 0,
                 on_lost: Optional[Callable[[str], None]] = None, can_lose_replicas: bool = True):
        """``can_lose_replicas``: False when a lost replica would break the weight transport
        (one broadcast group with a dead member): a loss then stops the run with a named error."""
        self.replicas, self.weights, self.version = list(replicas), weights, version
        # engines swap weights between two steps; HF generate replicas need the gate (weight_sync.py)
        self.inflight_weight_update = all(getattr(r, "inflight_weight_update", True) for r in self.replicas)
        self.router = Router(len(self.replicas))
        self.stats = [ReplicaStats() for _ in self.replicas]
        self.lost: list[int] = []
        self.regenerated_groups = 0
        self.on_lost = on_lost or (lambda message: None)
        self.can_lose_replicas = can_lose_replicas
        self._lock = threading.Lock()  # stats, losses
        self._keys = itertools.count()
        self._pool = ThreadPoolExecutor(4 * len(self.replicas), thread_name_prefix="asyncrl-fleet")

    @property
    def alive(self) -> list[int]:
        return sorted(self.router.alive)

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 session_ids: Optional[Sequence] = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order, each group generated by one replica;
        groups of a replica that dies meanwhile are generated again on the others."""
        prompts = [list(p) for p in prompt_token_ids]
        keys = list(session_ids) if session_ids is not None else [("group", next(self._keys)) for _ in prompts]
        costs = [params.n * (len(p) + params.max_tokens) for p in prompts]
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:
            placed: dict[int, list[int]] = {}
            for i in todo:
                placed.setdefault(self._place(keys[i], costs[i]), []).append(i)
            futures = {r: self._pool.submit(self._call, r, [prompts[i] for i in idx], params)
                       for r, idx in placed.items()}
            todo, error = [], None
            for replica, idx in placed.items():  # every future settled (and charged off) before raising
                try:
                    outputs = self._result(replica, futures[replica], [costs[i] for i in idx])
                except Exception as err:
                    error = error or err
                    continue
                if outputs is None:  # lost: these groups go to the other replicas
                    todo += idx
                    with self._lock:
                        self.regenerated_groups += len(idx)
                    continue
                for i, out in zip(idx, outputs):
                    results[i] = out
            if error is not None:
                raise error
        if session_ids is None:
            for key in keys:
                self.router.release(key)
        return results

    def end_session(self, session_id) -> None:
        """The conversation is over: its replica need not be kept for it."""
        self.router.release(session_id)

    def _place(self, key, cost: int) -> int:
        try:
            return self.router.place(key, cost)
        except RuntimeError as err:
            raise FleetError(f"every rollout replica is gone ({self._lost_note()})") from err

    def _call(self, replica: int, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        with self._lock:
            self.stats[replica].start(len(prompts))
        tokens = 0
        try:
            outputs = self.replicas[replica].generate(prompts, params)
            tokens = sum(len(c.token_ids) for out in outputs for c in out.completions)
            return outputs
        finally:
            with self._lock:
                self.stats[replica].end(len(prompts), tokens)

    def _result(self, replica: int, future, costs: list[int]) -> Optional[list[RequestOutput]]:
        """The replica's outputs, or None if it died (then it is removed)."""
        try:
            return future.result()
        except Exception as err:
            if self.replicas[replica].is_alive():
                raise
            self._lose(replica, err)
            return None
        finally:
            self.router.finish(replica, sum(costs))

    def _lose(self, replica: int, err: BaseException) -> None:
        with self._lock:
            if replica in self.lost:
                return
            self.lost.append(replica)
        self.router.remove(replica)
        name = getattr(self.replicas[replica], "name", f"replica {replica}")
        left = len(self.router.alive)
        if not self.can_lose_replicas:
            raise FleetError(f"{name} was lost and the weight transport cannot drop a member of its broadcast "
                             f"group (runtime.weight_transport=collective); use weight_transport=shared for a "
                             f"fleet that survives losses. Cause: {err}") from err
        self.on_lost(f"{name} lost ({err}); its groups are generated again on the other {left} replica(s)")
        if not left:
            raise FleetError(f"every rollout replica is gone ({self._lost_note()})") from err

    def _lost_note(self) -> str:
        return ", ".join(getattr(self.replicas[r], "name", f"replica {r}") + " lost" for r in self.lost) or "none lost"

    # ---- weights ----------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.start_update(named_tensors, version)()

    def start_update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> Callable[[], int]:
        """Write the weights once, tell every live replica to load them; returns ``loaded()``,
        which waits for every ack and only then sets ``version``. Call it before the next push."""
        self.weights.write(named_tensors, version)
        waiting = []
        for replica in self.alive:
            try:
                waiting.append((replica, self.replicas[replica].notify_update(version)))
            except Exception as err:
                self._lost_or_raise(replica, err)
        works = self.weights.send(version)

        def loaded() -> int:
            for replica, acked in waiting:
                try:
                    acked()
                except Exception as err:
                    self._lost_or_raise(replica, err)
            for work in works:
                work.wait()
            if not self.router.alive:
                raise FleetError(f"every rollout replica is gone ({self._lost_note()})")
            self.version = version
            return version
        return loaded

    def _lost_or_raise(self, replica: int, err: Exception) -> None:
        if self.replicas[replica].is_alive():
            raise err
        self._lose(replica, err)

    @property
    def restarts(self) -> int:
        """Dead replica processes replaced so far, over all replicas (``async/rollout_restarts``)."""
        return sum(getattr(replica, "restarts", 0) for replica in self.replicas)

    def replica_versions(self) -> dict[int, int]:
        """The version each live replica acknowledged last."""
        return {r: self.replicas[r].version for r in self.alive}

    def run_probe(self, probe, version: int):
        """The weight-sync probe on every live replica (in parallel); returns the result with
        the largest gap, or raises the first failure, naming its replica."""
        from asyncrl.runtime.weight_sync import WeightSyncError

        futures = {r: self._pool.submit(self.replicas[r].run_probe, probe, version) for r in self.alive}
        results = []
        for replica, future in futures.items():
            try:
                results.append(future.result())
            except WeightSyncError as err:
                raise WeightSyncError(f"{self.replicas[replica].name}: {err}") from err
            except Exception as err:
                self._lost_or_raise(replica, err)
        if not results:
            raise FleetError(f"every rollout replica is gone ({self._lost_note()})")
        return max(results, key=lambda result: result.gap)

    # ---- metrics and shutdown -------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float]:
        """Per replica since the last call: ``busy`` (fraction of the window with a call in
        flight), ``tokens_per_s`` (tokens / busy seconds), and now: ``queue_groups`` (groups
        placed, not done), ``kv_use`` (KV blocks in use / all), ``preemptions`` (total); and
        ``fleet/*`` totals: replicas alive and lost, the version spread over live replicas
        (0 after every sync), groups generated again after a loss, busy replica-seconds."""
        now = time.perf_counter()
        metrics: dict[str, float] = {}
        busy_total = 0.0
        for replica in self.alive:
            with self._lock:
                stats = self.stats[replica]
                t0, busy0, tokens0 = stats.window
                busy, tokens = stats.busy_now(now), stats.tokens
                stats.window = (now, busy, tokens)
                queue = stats.groups_in_flight
            busy_total += busy - busy0
            key = partial(member_key, "fleet", f"replica{replica}")
            metrics.update({key("busy"): (busy - busy0) / max(now - t0, 1e-9),
                            key("tokens_per_s"): (tokens - tokens0) / (busy - busy0) if busy > busy0 else 0.0,
                            key("queue_groups"): float(queue), **self._engine_metrics(replica, key)})
        versions = list(self.replica_versions().values())
        metrics.update({"fleet/replicas_alive": float(len(versions)), "fleet/replicas_lost": float(len(self.lost)),
                        "fleet/version_spread": float(max(versions) - min(versions)) if versions else 0.0,
                        "fleet/regenerated_groups": float(self.regenerated_groups),
                        "fleet/busy_replica_seconds": busy_total})
        return metrics

    def _engine_metrics(self, replica: int, key: Callable[[str], str]) -> dict[str, float]:
        try:
            m = self.replicas[replica].engine_metrics()
        except Exception:  # a replica dying now is handled by the next generate
            return {}
        if not m.get("num_blocks"):
            return {}
        return {key("kv_use"): 1.0 - m["free_blocks"] / m["num_blocks"], key("preemptions"): float(m["preemptions"])}

    @property
    def closing(self) -> bool:
        return any(getattr(replica, "closing", False) for replica in self.replicas)

    @closing.setter
    def closing(self, value: bool) -> None:
        """Set by the controller before stopping on purpose: a replica dying now is not restarted."""
        for replica in self.replicas:
            replica.closing = value

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop every replica (``timeout``: each one's, as ``RolloutProcess.close``; None: its default)."""
        try:
            for replica in self.replicas:
                replica.close() if timeout is None else replica.close(timeout)
        finally:
            self.weights.close()
            self._pool.shutdown(wait=False)
