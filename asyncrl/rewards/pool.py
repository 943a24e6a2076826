"""RewardPool: several weighted rewards, run in workers with a per-call timeout.

    total = sum_k weight_k * score_k

where ``score_k`` is component k's return value, or ``default_score`` when the call
raised, timed out, returned None or returned a non-finite / non-numeric value. Each
component's (unweighted) score is reported on its own so it can be logged as its own
metric; every failure is counted and kept (with the sample) in ``pool.failures``.

Invariant: every submitted item gets a result; no reward function can stop the run.
A call that hangs is stopped after ``timeout_s`` (process mode kills the worker and
starts a new one; thread mode abandons the thread; inline mode cannot stop it).

Usage::

    with RewardPool([RewardSpec("math", "math"), RewardSpec("fmt", "format", 0.1)]) as pool:
        results = pool.score([RewardRequest(prompt, response, {"answer": "42"})])
        futures = pool.submit(group)   # streaming: score a group while others generate
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from asyncrl.metrics.members import member_totals
from asyncrl.rewards.registry import resolve_reward
from asyncrl.rewards.workers import (
    CallOutcome,
    InlineRunner,
    ProcessRunner,
    ThreadRunner,
)

logger = logging.getLogger(__name__)

MODES = ("process", "thread", "inline")
# A failure record keeps this much of the prompt and response: enough to reproduce,
# small enough that a thousand failures do not fill memory.
_SAMPLE_CHARS = 2000


@dataclass
class RewardSpec:
    """One reward component: a name for logging, the function, its weight.

    ``fn`` is a registered name, ``"module:function"`` or a callable (process mode
    needs it picklable, i.e. defined at module level). ``kwargs`` are bound to every
    call (e.g. ``{"pattern": r"\\d+"}`` for ``regex``). A batched reward
    (``fn(prompts, responses, fields_list) -> scores``, marked by ``fn.batched = True``
    or ``batched=True`` here) is called once per ``submit`` with all its items.
    """

    name: str
    fn: Union[str, Callable]
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    batched: Optional[bool] = None  # None: the function's own ``batched`` attribute
    timeout_s: Optional[float] = None  # overrides the pool's per-call timeout (a batched call is one call)


@dataclass
class RewardRequest:
    """One response to score. ``fields`` are passed to rewards as keyword arguments
    (the dataset row's extra fields, with ``answer``)."""

    prompt: str
    response: str
    fields: dict = field(default_factory=dict)


@dataclass
class RewardResult:
    """``total`` is the weighted sum; ``components`` the raw score per reward name;
    ``failed`` maps a failed component's name to its error."""

    total: float
    components: dict[str, float]
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class RewardFailure:
    """A recorded failure, with the sample that caused it."""

    reward: str
    kind: str  # "error" | "timeout" | "none" | "invalid"
    error: str
    prompt: str
    response: str
    fields: dict


@dataclass
class _ComponentStats:
    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    nones: int = 0
    seconds: float = 0.0


class _Pending:
    """Collects the component outcomes of one item and resolves its future."""

    def __init__(self, request: RewardRequest, n_components: int):
        self.request = request
        self.future: Future = Future()
        self.components: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.remaining = n_components


class RewardPool:
    """Weighted rewards run by ``num_workers`` slots with a per-call timeout."""

    def __init__(
        self,
        specs: list[RewardSpec],
        num_workers: int = 2,
        timeout_s: float = 10.0,
        default_score: float = 0.0,
        mode: str = "process",
        start_method: str = "forkserver",
        max_failures_kept: int = 200,
    ):
        if not specs:
            raise ValueError("RewardPool needs at least one RewardSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError("num_workers must be >= 1 and timeout_s > 0")
        self._batched = {}
        for spec in specs:  # fail at construction, in the caller, on a bad spec
            fn = resolve_reward(spec.fn)
            self._batched[spec.name] = bool(getattr(fn, "batched", False) if spec.batched is None else spec.batched)
        self.specs = list(specs)
        self.timeout_s = float(timeout_s)
        self.default_score = float(default_score)
        self.mode = mode
        self.failures: deque[RewardFailure] = deque(maxlen=max_failures_kept)
        self._stats = {s.name: _ComponentStats() for s in specs}
        self._lock = threading.Lock()
        self._closed = False
        worker_specs = [(s.name, s.fn, dict(s.kwargs)) for s in specs]
        if mode == "inline":
            self._inline = InlineRunner(worker_specs)
            self._runners, self._threads = [], []
            return
        self._jobs: queue.Queue = queue.Queue()
        factory = {"thread": lambda: ThreadRunner(worker_specs),
                   "process": lambda: ProcessRunner(worker_specs, start_method)}[mode]
        self._runners = []
        try:
            for _ in range(num_workers):
                self._runners.append(factory())
        except BaseException:  # do not leak the workers that did start
            for runner in self._runners:
                runner.close()
            raise
        self._threads = [
            threading.Thread(target=self._slot_loop, args=(r,), name=f"reward-slot-{i}", daemon=True)
            for i, r in enumerate(self._runners)
        ]
        for thread in self._threads:
            thread.start()

    # -- public API ---------------------------------------------------------------

    def submit(self, items: list[RewardRequest]) -> list[Future]:
        """One future per item, resolving to its ``RewardResult``; never raises
        for a reward's failure. In inline mode the futures are already done."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        pendings = [_Pending(item, len(self.specs)) for item in items]
        if not pendings:
            return []
        for spec in self.specs:
            if self._batched[spec.name]:
                self._dispatch(pendings, spec)
        # Item-major order: the first items complete first, which is what a caller
        # streaming results (and a runtime scoring groups as they finish) wants.
        for pending in pendings:
            for spec in self.specs:
                if not self._batched[spec.name]:
                    self._dispatch(pending, spec)
        return [p.future for p in pendings]

    def _dispatch(self, target: Union[_Pending, list[_Pending]], spec: RewardSpec) -> None:
        """Run now (inline) or queue for a slot; ``target`` is a list for batched rewards."""
        if self.mode == "inline":
            self._run(self._inline, target, spec)
        else:
            self._jobs.put((target, spec))

    def score(self, items: list[RewardRequest]) -> list[RewardResult]:
        """Score a batch and wait for all results (in input order)."""
        return [future.result() for future in self.submit(items)]

    def stats(self) -> dict[str, Any]:
        """Totals and per-component counters: calls, failures, timeouts, nones, seconds.

        ``seconds`` is the summed wall time of calls (across workers), the cost a
        ``reward_time`` metric should report next to the pool's elapsed time.
        """
        with self._lock:
            per = {name: vars(s).copy() for name, s in self._stats.items()}
        totals = member_totals(per, ("calls", "failures", "timeouts", "nones", "seconds"))
        totals["worker_restarts"] = sum(getattr(r, "restarts", 0) for r in self._runners)
        totals["threads_abandoned"] = sum(getattr(r, "abandoned", 0) for r in self._runners)
        return {**totals, "components": per}

    def close(self) -> None:
        """Stop the slots and the worker processes. Items still queued are not run:
        their futures resolve with the default score and a "pool closed" failure, so
        no caller waits forever."""
        if self._closed:
            return
        self._closed = True
        if self.mode != "inline":
            self._cancel_queued()
            for _ in self._threads:
                self._jobs.put(None)
            longest = max([s.timeout_s or self.timeout_s for s in self.specs])
            for thread in self._threads:
                thread.join(longest + 5)
        for runner in self._runners:
            runner.close()

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            target, spec = job
            items = target if isinstance(target, list) else [target]
            for pending in items:
                self._finish(pending, spec, CallOutcome("error", error="pool closed before this call ran"))

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _slot_loop(self, runner) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(runner, *job)

    def _run(self, runner, target: Union[_Pending, list[_Pending]], spec: RewardSpec) -> None:
        """One call (a single item, or a whole batch for a batched reward)."""
        batched = isinstance(target, list)
        items = target if batched else [target]
        requests = [p.request for p in items]
        timeout_s = spec.timeout_s or self.timeout_s
        try:
            if batched:
                outcome = runner.call(spec.name, [r.prompt for r in requests], [r.response for r in requests],
                                      [r.fields for r in requests], timeout_s, batched=True)
            else:
                outcome = runner.call(spec.name, requests[0].prompt, requests[0].response,
                                      requests[0].fields, timeout_s)
        except Exception as err:  # e.g. a replacement worker failed to start
            outcome = CallOutcome("error", error=f"reward runner failed: {type(err).__name__}: {err}")
        if not batched:
            self._finish(items[0], spec, outcome)
            return
        for pending, item_outcome in zip(items, self._split(outcome, len(items))):
            self._finish(pending, spec, item_outcome)

    @staticmethod
    def _split(outcome: CallOutcome, n: int) -> list[CallOutcome]:
        """A batched call's outcome as n per-item outcomes (its time shared equally)."""
        seconds = outcome.seconds / n
        if outcome.status != "ok":
            return [CallOutcome(outcome.status, error=outcome.error, seconds=seconds)] * n
        values = outcome.value
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            error = f"batched reward returned {got} for {n} items; expected a list of {n} scores"
            return [CallOutcome("error", error=error, seconds=seconds)] * n
        return [CallOutcome("ok", v, seconds=seconds) for v in values]

    def _finish(self, pending: _Pending, spec: RewardSpec, outcome: CallOutcome) -> None:
        """Turn one outcome into a component score; resolve the item when complete."""
        score, kind, error = self._interpret(outcome)
        with self._lock:
            stats = self._stats[spec.name]
            stats.calls += 1
            stats.seconds += outcome.seconds
            if kind == "none":
                stats.nones += 1
            elif kind is not None:
                stats.failures += 1
                stats.timeouts += kind == "timeout"
            pending.components[spec.name] = score
            if kind is not None and kind != "none":
                pending.failed[spec.name] = error
                self._record(spec.name, kind, error, pending.request)
            pending.remaining -= 1
            done = pending.remaining == 0
        if done:
            total = sum(s.weight * pending.components[s.name] for s in self.specs)
            components = {s.name: pending.components[s.name] for s in self.specs}
            failed = dict(pending.failed)
            if not math.isfinite(total):  # finite scores whose weighted sum overflows (1e308 x 2)
                failed["total"] = f"the weighted total is {total} (weights x scores overflow)"
                total = self.default_score
                with self._lock:
                    self._record("total", "invalid", failed["total"], pending.request)
            pending.future.set_result(RewardResult(total, components, failed))

    def _interpret(self, outcome: CallOutcome) -> tuple[float, Optional[str], str]:
        """(score, failure kind or None, error text)."""
        if outcome.status != "ok":
            return self.default_score, outcome.status, outcome.error
        value = outcome.value
        if value is None:
            return self.default_score, "none", ""
        if isinstance(value, bool) or isinstance(value, (int, float)) or hasattr(value, "__float__"):
            try:
                number = float(value)
            except Exception:
                number = math.nan
            if math.isfinite(number):
                return number, None, ""
            return self.default_score, "invalid", f"reward returned a non-finite value {value!r}"
        return self.default_score, "invalid", f"reward returned {type(value).__name__}, not a number"

    def _record(self, name: str, kind: str, error: str, request: RewardRequest) -> None:
        """Keep the failure with its sample and log it (called under the lock)."""
        self.failures.append(RewardFailure(
            reward=name, kind=kind, error=error,
            prompt=request.prompt[:_SAMPLE_CHARS], response=request.response[:_SAMPLE_CHARS],
            fields={k: repr(v)[:_SAMPLE_CHARS] for k, v in request.fields.items()},
        ))
        logger.warning("reward %r %s: %s | response: %r", name, kind, error, request.response[:200])
