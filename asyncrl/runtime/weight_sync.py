"""Weight sync from the trainer to a rollout backend that holds its *own* copy of the weights,
and the log-prob probe that proves the copy took.

Two ways to load weights while generation runs:
  * in flight (the engine: ``backend.inflight_weight_update``): ``update_weights`` runs between
    two engine steps; sequences keep their KV and continue, later tokens carry the new version;
  * gated (HF ``generate``, which cannot be interrupted): a :class:`GenerationGate` lets many
    ``generate`` calls run together, and a weight update waits for them to end and keeps new
    ones out while it copies (OpenRLHF's generation lock, as a reader/writer lock).
"""
from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from asyncrl.errors import HangError
from asyncrl.training.lora import is_lora, merged_tensors, sync_tensors
from asyncrl.training.logprobs import response_logprobs
from asyncrl.types import SamplingParams


class WeightSyncError(RuntimeError):
    """The rollout backend does not run the weights it was sent."""


def clone_for_rollout(model: torch.nn.Module, share_frozen: bool = False) -> torch.nn.Module:
    """A separate copy of the policy for generation.

    Invariant: no clone parameter has the data_ptr of a *trainable* trainer parameter, so an
    optimizer step cannot change the weights a running ``generate`` reads. ``share_frozen``:
    parameters that do not require grad (a LoRA model's base, which no step writes) are the
    trainer's own, not copies."""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad} if share_frozen else {}
    clone = copy.deepcopy(model, memo).eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


def rollout_weights(model: torch.nn.Module, backend) -> list[tuple[str, torch.Tensor]]:
    """The named tensors a push hands ``backend``: every parameter (full fine-tuning), the LoRA
    adapters (a backend that applies them itself: the engine's LoRA slots, a PEFT clone, the
    rollout process), or the adapted layers' merged weights W + (α/r)·B·A for an engine that
    serves the merged model (``backend.merged_lora``).

    Adapters go in the dtype the backend holds them in (``backend.adapter_dtype``: the engine's
    slots, bf16 under a bf16 engine), cast here on the sender as a full sync sends the model's
    own dtype: PEFT keeps A and B in fp32 under a bf16 base, and the engine would drop half of
    those bytes on arrival. The merged weights are computed from the fp32 adapters (exact)."""
    if is_lora(model) and getattr(backend, "merged_lora", False):
        return merged_tensors(model)
    tensors = sync_tensors(model)
    dtype = getattr(backend, "adapter_dtype", None) if is_lora(model) else None
    if dtype is None:
        return tensors
    return [(name, t.detach().to(dtype)) for name, t in tensors]


class GenerationGate:
    """Reader/writer lock: readers = ``generate`` calls, writer = a weight update.

    Invariant: while a writer holds the gate, ``readers == 0``; a waiting writer blocks new
    readers (writer preference), so an update is not starved by a stream of generations."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


# Default probe tolerance per model dtype: in float32 the engine and the trainer agree to ~1e-5
# nats; in 16-bit their kernels round differently (measured 3e-3 on the 2-layer tiny model, and
# the gap grows with depth), so a 1e-3 bar would fail a correct sync.
DEFAULT_PROBE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def probe_tolerance(configured: Optional[float], dtype: str) -> float:
    """``runtime.probe_tolerance``, or the default for ``model.dtype`` when it is null."""
    return configured if configured is not None else DEFAULT_PROBE_TOLERANCE[dtype]


@dataclass
class ProbeResult:
    gap: float        # max |lp_backend − lp_trainer| over the probe tokens (0 when in sync)
    delta: float      # max |lp_trainer − lp_trainer at the previous sync|: how much the weights moved


class LogprobProbe:
    """After a sync to version v, sample a few tokens of a fixed prompt from the backend and
    recompute their log-probs with the trainer's model.

    Passes iff every probe token is tagged v and max_t |lp_backend,t − lp_trainer,t| ≤ tolerance.
    A backend still on the old weights shows a gap of about ``delta`` (the log-prob change
    the update caused), so the probe can tell old from new when delta > tolerance."""

    def __init__(self, prompt_ids: list[int], temperature: float, tolerance: float, max_tokens: int = 4,
                 chunk_tokens: int = 4096, seed: int = 0):
        self.prompt_ids, self.tolerance = list(prompt_ids), tolerance
        self.params = SamplingParams(n=1, temperature=temperature, max_tokens=max_tokens, seed=seed, logprobs=True,
                                     ignore_eos=True)
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self._last: Optional[tuple[list[int], torch.Tensor]] = None

    def check(self, backend, model: torch.nn.Module, version: int) -> ProbeResult:
        return self.verify(model, self.sample(backend, version), version)

    def sample(self, backend, version: int):
        """The backend's probe completion (any thread; its tokens must all carry ``version``)."""
        completion = backend.generate([self.prompt_ids], self.params)[0].completions[0]
        if any(v != version for v in completion.versions):
            raise WeightSyncError(f"probe tokens tagged with versions {completion.versions}, expected {version}")
        return completion

    def verify(self, model: torch.nn.Module, completion, version: int) -> ProbeResult:
        """Compare ``completion``'s log-probs with ``model``'s, which must hold ``version``."""
        trainer_lp = self._trainer_logprobs(model, completion.token_ids)
        gap = float((torch.tensor(completion.logprobs) - trainer_lp).abs().max())
        delta = self._delta(model, completion.token_ids, trainer_lp)
        self._last = (completion.token_ids, trainer_lp)
        if gap > self.tolerance:
            raise WeightSyncError(
                f"weight sync to version {version} did not take: the rollout backend's log-probs differ from the "
                f"trainer's by {gap:.2e} (> runtime.probe_tolerance={self.tolerance:g}); the weights moved by "
                f"{delta:.2e} in this update. The backend is running other weights than the trainer sent.")
        return ProbeResult(gap, delta)

    def _delta(self, model, token_ids: list[int], trainer_lp: torch.Tensor) -> float:
        if self._last is None:
            return 0.0
        old_tokens, old_lp = self._last
        if old_tokens != token_ids:  # a different sample: compare on the old tokens
            return float((self._trainer_logprobs(model, old_tokens) - old_lp).abs().max())
        return float((trainer_lp - old_lp).abs().max())

    @torch.no_grad()
    def _trainer_logprobs(self, model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
        device = next(model.parameters()).device
        ids = torch.tensor([self.prompt_ids + list(token_ids)], device=device)
        was_training = model.training
        model.eval()
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), len(self.prompt_ids), self.temperature,
                                  self.chunk_tokens, with_entropy=False)
        model.train(was_training)
        return lp[0].float().cpu()


class WeightSync:
    """Pushes the trainer's weights into the rollout backend and probes them.

    Invariant: ``on_loaded(v)`` (the controller raises the admission version there) runs only
    once the backend holds version v; after ``push(v)`` returns, or at the latest when the next
    push or ``close`` returns, the backend's log-probs matched the trainer's within tolerance
    (if probing); otherwise one of them raised.

    Synchronous (in process): ``push`` copies, probes, calls ``on_loaded`` and returns.

    Deferred (an in-flight backend with ``start_update``/``run_probe``: the rollout process):
    ``push(v)`` copies the weights into shared memory, sends the version and returns at once; a
    background thread waits for the child's ack, calls ``on_loaded(v)``, and has the child run
    the probe (its engine against an HF forward over the shared tensors, which hold exactly
    version v until the next push). ``push(v+1)`` waits for all that before it overwrites the
    shared tensors, returns the probe's metrics (or raises its error); ``check`` raises a
    failure early (the trainer calls it while waiting for data) and ``close`` checks the last
    one. Every sync is verified, one step late; the trainer's process spends ~nothing on it."""

    def __init__(self, backend, gate: GenerationGate, probe: Optional[LogprobProbe], inflight: bool,
                 on_loaded: Callable[[int], None] = lambda version: None, timeout_s: Optional[float] = None,
                 overlap_probe: bool = False, probe_every: int = 1):
        """``timeout_s``: the longest wait for a deferred load + probe (``runtime.hang_timeout_s``).
        ``probe_every`` (``runtime.probe_every``): probe the first push and every N-th after it; the
        pushes in between load only (``weight_sync/probed`` says which did).
        ``overlap_probe`` (an in-flight backend in this process: the engine): the probe's generate
        runs in the background, next to the rollout's, and :meth:`finish_probe` compares it with
        the trainer before the trainer's next update (the weights are still the pushed ones then)."""
        self.backend, self.gate, self.probe, self.inflight = backend, gate, probe, inflight
        self.on_loaded, self.timeout_s = on_loaded, timeout_s
        self.deferred = inflight and hasattr(backend, "start_update") and hasattr(backend, "run_probe")
        self.overlapped = overlap_probe and inflight and not self.deferred and probe is not None
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="asyncrl-probe")
                      if self.deferred or self.overlapped else None)
        self._pending: Optional[Future] = None
        self._probing: Optional[tuple[int, Future]] = None  # overlapped: (version, its probe sample)
        self.probe_every, self._pushes = probe_every, 0

    def _probe_due(self) -> bool:
        """Whether this push is probed (counted per push, not per version: a resumed run probes
        its first push too)."""
        due = self.probe is not None and self._pushes % self.probe_every == 0
        self._pushes += 1
        return due

    def push(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        if self.overlapped and self._probing is not None:
            raise RuntimeError("finish_probe must run between a push and the trainer's next update")
        due = self._probe_due()
        sent = {"weight_sync/probed": float(due)} if self.probe is not None else {}
        if self.deferred:
            metrics = self.wait()  # the previous load and probe read the tensors this push overwrites
            started = time.perf_counter()
            tensors = rollout_weights(model, self.backend)
            loaded = self.backend.start_update(tensors, version)
            self._pending = self._pool.submit(self._load_then_probe, loaded, version, started, due)
            return {**metrics, **sent, "weight_sync/bytes": _nbytes(tensors)}
        tensors = rollout_weights(model, self.backend)
        if self.overlapped and due:  # load now, probe in the background; finish_probe before the next update
            self.backend.update_weights(tensors, version)
            self._probing = (version, self._pool.submit(self._sample_then_admit, version))
            return {**_update_timing(self.backend), **sent, "weight_sync/bytes": _nbytes(tensors)}
        probe = (lambda: self._probe(model, version)) if due else dict
        if self.inflight:  # the engine swaps weights between two steps; running requests continue
            self.backend.update_weights(tensors, version)
            metrics = {**_update_timing(self.backend), **probe()}
        else:
            with self.gate.writing():  # wait for running generate calls, keep new ones out
                self.backend.update_weights(tensors, version)
                metrics = {**_update_timing(self.backend), **probe()}
        self.on_loaded(version)
        return {**metrics, **sent, "weight_sync/bytes": _nbytes(tensors)}

    def wait(self) -> dict[str, float]:
        """The metrics of the deferred load + probe in flight ({} if none); raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}
        try:
            return pending.result(timeout=self.timeout_s)
        except FuturesTimeout:
            raise HangError(f"the weight sync (load + probe of the last push) did not finish in {self.timeout_s:g} s "
                            "(runtime.hang_timeout_s)") from None

    def _sample_then_admit(self, version: int):
        """The overlapped probe's sample; the admission version rises after it (as after a probe in
        the push): a rollout that waits for admission leaves the engine to the probe's few steps,
        which a freshly admitted batch would otherwise share (its prefill first), while the trainer
        may already wait in ``finish_probe``. A rollout still generating is not held up."""
        completion = self.probe.sample(self.backend, version)
        self.on_loaded(version)
        return completion

    def finish_probe(self, model: torch.nn.Module) -> dict[str, float]:
        """Overlapped probe: compare the backend's probe sample of the last push with ``model``,
        which must still hold the pushed weights (call it before the next update); {} if none.
        Raises WeightSyncError as the synchronous probe does, one step later."""
        probing, self._probing = self._probing, None
        if probing is None:
            return {}
        version, sample = probing
        started = time.perf_counter()
        try:
            completion = sample.result(timeout=self.timeout_s)
        except FuturesTimeout:
            raise HangError(f"the weight-sync probe of version {version} did not finish in {self.timeout_s:g} s "
                            "(runtime.hang_timeout_s)") from None
        return {**_probe_metrics(self.probe.verify(model, completion, version)),
                "weight_sync/probe_s": time.perf_counter() - started}

    def check(self) -> None:
        """Raise now if the deferred load or probe in flight already failed."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            self.wait()
        probing = self._probing
        if probing is not None and probing[1].done() and probing[1].exception() is not None:
            self._probing = None
            probing[1].result()  # raises the sample's error (e.g. tokens tagged with another version)

    def close(self, raise_pending: bool = True, model: Optional[torch.nn.Module] = None) -> None:
        """Check the last deferred probe (a stale backend at the end still fails the run), and the
        last overlapped one against ``model`` (the trainer's, not updated since that push);
        ``raise_pending=False`` drops them (the run already failed)."""
        try:
            if raise_pending:
                self.wait()
                if model is not None:
                    self.finish_probe(model)
            else:
                self._pending = self._probing = None
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _load_then_probe(self, loaded: Callable[[], int], version: int, started: float,
                         due: bool = True) -> dict[str, float]:
        loaded()
        # push -> the child's ack: copy, transfer, and the wait for an engine step boundary
        metrics = {"weight_sync/load_latency_s": time.perf_counter() - started}
        self.on_loaded(version)
        if self.probe is None or not due:
            return metrics
        return {**metrics, **_probe_metrics(self.backend.run_probe(self.probe, version))}

    def _probe(self, model, version: int) -> dict[str, float]:
        if self.probe is None:
            return {}
        started = time.perf_counter()
        return {**_probe_metrics(self.probe.check(self.backend, model, version)),
                "weight_sync/probe_s": time.perf_counter() - started}


def _nbytes(named_tensors) -> float:
    """Bytes of the tensors a push handed the backend (LoRA: A and B; else the whole model)."""
    return float(sum(t.numel() * t.element_size() for _, t in named_tensors))


def _update_timing(backend) -> dict[str, float]:
    """Where the last in-process load spent its time (the engine reports it): waiting for the
    engine's step in flight to end (``weight_sync/wait_s``), and copying (``weight_sync/load_s``)."""
    timing = getattr(backend, "last_update_timing", None)
    if timing is None:
        return {}
    return {"weight_sync/wait_s": timing[0], "weight_sync/load_s": timing[1]}


def _probe_metrics(result: ProbeResult) -> dict[str, float]:
    return {"weight_sync/probe_gap": result.gap, "weight_sync/probe_delta": result.delta}
