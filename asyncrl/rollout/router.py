"""Placement of GRPO groups and multi-turn sessions on engine replicas (SCALE.md §2.2, §2.5).

The unit of placement is a *key*: a group (one prompt and its n samples, sent whole to one
replica, so its engine prefills the prompt once and forks its KV n ways instead of every
replica prefilling it) or a session (every turn of a conversation on the replica whose prefix
cache holds its history).

A new key goes to the live replica with the fewest outstanding tokens (prompt + max new
tokens, times n, of the work placed there and not yet finished), not round-robin: a replica
busy with long requests gets fewer new ones (verl's least-in-flight and SGLang's shortest
queue, counted in tokens). Ties go to the lowest index. The key then sticks to its replica
until released (a group when it finishes; a session when the caller ends it, or when it is the
least recently used of more than ``max_sticky``).

Invariants: ``outstanding[r]`` = the cost of the placements on replica r not yet finished;
every sticky key maps to a live replica (removing a replica forgets its keys, which are then
placed afresh on the others).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable


class NoReplicaLeft(RuntimeError):
    """Every replica was removed."""


class Router:
    """Thread-safe: the rollout threads place and finish concurrently."""

    def __init__(self, num_replicas: int, max_sticky: int = 100_000):
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.outstanding = [0] * num_replicas
        self.alive = set(range(num_replicas))
        self.max_sticky = max_sticky
        self._sticky: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def place(self, key: Hashable, cost: int) -> int:
        """The replica for ``key`` (its sticky one if live, else the least loaded), charged ``cost``."""
        with self._lock:
            replica = self._sticky.get(key)
            if replica is None:
                if not self.alive:
                    raise NoReplicaLeft("every rollout replica was removed")
                replica = min(self.alive, key=lambda r: (self.outstanding[r], r))
                self._sticky[key] = replica
                if len(self._sticky) > self.max_sticky:
                    self._sticky.popitem(last=False)
            self._sticky.move_to_end(key)
            self.outstanding[replica] += cost
            return replica

    def finish(self, replica: int, cost: int) -> None:
        """Work of ``cost`` placed on ``replica`` is done (or lost)."""
        with self._lock:
            self.outstanding[replica] -= cost

    def release(self, key: Hashable) -> None:
        """Forget ``key`` (its group finished, or its session ended)."""
        with self._lock:
            self._sticky.pop(key, None)

    def remove(self, replica: int) -> None:
        """``replica`` is gone: never chosen again, and its keys are placed afresh."""
        with self._lock:
            self.alive.discard(replica)
            for key in [k for k, r in self._sticky.items() if r == replica]:
                del self._sticky[key]
