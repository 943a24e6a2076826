"""Rank 0 drives, the other ranks replay: how the sharded trainer keeps every collective in
the same order on every rank.

Only rank 0 runs the training job (rollout, rewards, the controller, evaluation, metrics,
checkpoint decisions, signals). Each call that needs every rank (a forward under FSDP2, an
update, the weight stream, a checkpoint) is a method of a *role* decorated with
:func:`replicated`: on rank 0 the call is first announced (one broadcast of the role name,
method and arguments), then run; the other ranks sit in :func:`serve`, receive the
announcement and make the same call on their own copy of the role. A decision taken on rank
0 alone (stop after a time budget, skip an eval, DAPO's extra rounds) therefore never splits
the ranks' collective sequences: they have no other source of calls. verl's single
controller over SPMD workers, with the controller inside worker 0.

Invariant: on rank 0 every top-level replicated call is announced exactly once and before any
of its collectives; calls nested in a replicated call are not announced (the followers make
them inside their own replay); :func:`finish` ends every follower's :func:`serve`.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, ContextManager, Optional

from asyncrl.distributed.group import DataParallel

_depth = threading.local()


def _nesting() -> int:
    return getattr(_depth, "value", 0)


def _leading(dp: DataParallel) -> bool:
    return dp.lockstep and dp.world_size > 1 and dp.is_main and _nesting() == 0


def announce(dp: DataParallel, role: str, method: str, *args: Any, **kwargs: Any) -> None:
    """On rank 0 of a multi-rank lockstep group, outside another replicated call: tell the
    followers to call ``role.method(*args, **kwargs)``. A no-op everywhere else (SPMD code,
    where every rank makes the call itself)."""
    if _leading(dp):
        dp.broadcast_object((role, method, args, kwargs))


def replicated(role: str) -> Callable:
    """Decorator for a method of a role object with a ``dp`` attribute: rank 0 announces the
    call (arguments are pickled: pass batches and numbers, not handles) before running it."""
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            announce(self.dp, role, method.__name__, *args, **kwargs)
            _depth.value = _nesting() + 1
            try:
                return method(self, *args, **kwargs)
            finally:
                _depth.value -= 1
        return call
    return decorate


def serve(dp: DataParallel, roles: dict[str, Any],
          around: Optional[Callable[[str, str], ContextManager]] = None) -> int:
    """A follower's loop: replay rank 0's announced calls on ``roles`` (a role may add roles
    to the dict) until :func:`finish`; ``around(role, method)`` wraps each call (e.g. a
    memory probe). Returns how many calls it replayed."""
    calls = 0
    while True:
        role, method, args, kwargs = dp.broadcast_object(None)
        if role is None:
            return calls
        with around(role, method) if around is not None else contextlib.nullcontext():
            getattr(roles[role], method)(*args, **kwargs)
        calls += 1


def finish(dp: DataParallel) -> None:
    """Rank 0: release the followers (they return from :func:`serve`)."""
    if _leading(dp):
        dp.broadcast_object((None, None, (), {}))
