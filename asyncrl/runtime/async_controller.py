"""The asynchronous controller: the rollout loop and the train loop run at the same time.

    rollout side (executor threads / Ray):  admit (staleness.py) -> generate on the rollout
        backend's own weights -> score each completion as it completes -> buffer
    train side (this object's ``step``):    take B groups in admission order (buffer.py) ->
        the sync controller's trainer stages -> every ``sync_every`` updates push weights
        (weight_sync.py) and raise the admission version

Invariant: a token trained at trainer version j was produced by weights of version ≥ j − η
(η = ``runtime.max_staleness``; proof in staleness.py); a sample over the bound is counted in
``async/staleness_violations`` (never dropped), which must stay 0. With η = 0 the rollout
admits one batch per version, so the run is the sync controller's, step for step.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from asyncrl.metrics.health import SampleStats
from asyncrl.runtime.buffer import RolloutBuffer, ScoredGroup
from asyncrl.runtime.dynamic_sampling import ScoredGroups
from asyncrl.runtime.executors.rollout_loop import InFlight, RolloutLoop
from asyncrl.runtime.staleness import StalenessManager, staleness_metrics
from asyncrl.runtime.roles import build_roles
from asyncrl.runtime.sync_controller import SyncController
from asyncrl.runtime.validate import validate_config
from asyncrl.runtime.waits import Deadline
from asyncrl.runtime.weight_sync import (GenerationGate, LogprobProbe, WeightSync, clone_for_rollout, probe_tolerance,
                                         rollout_weights)
from asyncrl.training.batch import build_train_batch
from asyncrl.training.critic import Critic
from asyncrl.types import Example

PROBE_TEXT = "12+34="


def build_rollout_backend(cfg, model, tokenizer, log_dir=None):
    """A backend with its own copy of the weights (never the trainer's tensors); ``auto`` as in
    ``rollout.registry`` (the engine for the architectures it implements); in a child process
    with ``runtime.rollout_process`` (executors/process.py); a fleet of replica processes with
    ``rollout.engines`` > 1 or ``rollout.tensor_parallel_size`` > 1 (their logs in ``log_dir``);
    episodes of ``workflow.fn`` on it."""
    from asyncrl.workflows.build import wrap_backend

    return wrap_backend(cfg, _single_turn_backend(cfg, model, tokenizer, log_dir), tokenizer)


def _single_turn_backend(cfg, model, tokenizer, log_dir=None):
    from asyncrl.rollout.registry import build_backend, engine_options, engine_stream_priority, resolve_backend_name

    name, kv = resolve_backend_name(cfg.rollout.backend, model), cfg.runtime.partial_rollout_kv
    if name == "openai":  # the server holds its own weights
        return build_backend(name, model, tokenizer, **engine_options(cfg.rollout))
    if cfg.rollout.engines > 1 or cfg.rollout.tensor_parallel_size > 1:
        return _start_fleet(cfg, model, tokenizer, name, log_dir)
    if cfg.runtime.rollout_process and cfg.runtime.executor == "local":
        from asyncrl.runtime.executors.process import ProcessRolloutBackend

        return ProcessRolloutBackend(model, tokenizer, name, kv_on_update=kv, dtype=getattr(torch, cfg.model.dtype),
                                     engine_options=engine_options(cfg.rollout, cfg.actor.lora), device=cfg.runtime.rollout_device,
                                     transport=cfg.runtime.weight_transport, max_restarts=cfg.runtime.max_restarts,
                                     hang_timeout_s=cfg.runtime.hang_timeout_s, on_restart=_announce_restart)
    if name == "engine":
        from asyncrl.rollout.engine_backend import EngineBackend  # copies the HF module's weights

        device = str(next(model.parameters()).device)
        options = {**engine_options(cfg.rollout, cfg.actor.lora),  # a thread of this process: its own stream (auto)
                   "stream_priority": engine_stream_priority(cfg.rollout.engine_stream, async_thread=True)}
        return EngineBackend(model, tokenizer, dtype=getattr(torch, cfg.model.dtype), device=device, kv_on_update=kv,
                             **options)
    from asyncrl.rollout.hf import HFGenerateBackend

    return HFGenerateBackend(clone_for_rollout(model, share_frozen=True), tokenizer)  # LoRA: the base is shared


def _start_fleet(cfg, model, tokenizer, backend_name: str, log_dir):
    from asyncrl.metrics.console import console
    from asyncrl.rollout.registry import engine_options
    from asyncrl.runtime.executors.replicas import start_fleet

    r = cfg.rollout
    return start_fleet(model, tokenizer, backend_name, engines=r.engines, tensor_parallel_size=r.tensor_parallel_size,
                       rollout_device=cfg.runtime.rollout_device or str(next(model.parameters()).device),
                       transport=cfg.runtime.weight_transport, kv_on_update=cfg.runtime.partial_rollout_kv,
                       dtype=getattr(torch, cfg.model.dtype), engine_options=engine_options(r), log_dir=log_dir,
                       start_timeout_s=r.replica_start_timeout_s,
                       on_lost=lambda message: console.print(f"[bold yellow]fleet[/] {message}"),
                       max_restarts=cfg.runtime.max_restarts, hang_timeout_s=cfg.runtime.hang_timeout_s,
                       on_restart=_announce_restart)


def build_async_controller(cfg, model, tokenizer, reward_fn, prompt_stream, encode=None,
                           backend=None, log_dir=None) -> "AsyncController":
    """The async controller and its roles; ``backend`` defaults to :func:`build_rollout_backend`
    (replica logs, if a fleet, in ``log_dir``)."""
    validate_config(cfg)
    actor, reference, critic = build_roles(cfg, model)
    if cfg.runtime.executor == "ray":  # generation and rewards in Ray actors, behind the same contracts
        from asyncrl.runtime.executors.ray import ray_roles

        backend, reward_fn, placement = ray_roles(cfg, model, tokenizer, reward_fn, log_dir)
        backend.placement_group = placement
    backend = backend if backend is not None else build_rollout_backend(cfg, model, tokenizer, log_dir)
    return AsyncController(cfg, actor, reference, backend, tokenizer, reward_fn, prompt_stream, critic=critic,
                           encode=encode)


class AsyncController(SyncController):
    """The sync controller's trainer stages over a buffer filled concurrently (see module doc)."""

    def __init__(self, cfg, actor, reference, backend, tokenizer, reward_fn, prompt_stream,
                 critic: Optional[Critic] = None, encode: Optional[Callable[[Example], list[int]]] = None):
        super().__init__(cfg, actor, reference, backend, tokenizer, reward_fn, prompt_stream, critic, encode)
        if any(p.data_ptr() == q.data_ptr() for p in _params(backend) for q in actor.trainable):
            raise ValueError("async mode needs a rollout model separate from the trainer's (clone_for_rollout)")
        rt, batch = cfg.runtime, cfg.trainer.prompts_per_step
        self.rt, self.batch_groups = rt, batch
        self.staleness = StalenessManager(batch, rt.max_staleness, rt.max_concurrent or (rt.max_staleness + 1) * batch,
                                          version=backend.version)
        self.buffer = RolloutBuffer((rt.max_staleness + 1) * batch)
        self.inflight = InFlight(self.staleness, self.buffer, rt.straggler_policy)
        gate = GenerationGate()
        inflight_update = rt.partial_rollout and getattr(backend, "inflight_weight_update", False)
        # the admission version rises only once the backend holds the weights (deferred: on the ack)
        # a backend whose generate may run in two threads at once (the engine in this process): the
        # probe's generate overlaps the rollout's and is compared with the trainer before its next
        # update (finish_probe in ``step``), so the push itself costs a load, as in sync mode
        self.weight_sync = WeightSync(backend, gate, self._probe() if rt.probe else None, inflight_update,
                                      on_loaded=self.staleness.set_version, timeout_s=rt.hang_timeout_s,
                                      overlap_probe=getattr(backend, "concurrent_generate", False),
                                      probe_every=rt.probe_every)
        self.loop = RolloutLoop(backend, self.staleness, self.inflight, prompt_stream, self.encode, self.params,
                                rt.rollout_chunk or batch, cfg.seed, self.score,
                                lambda task: self.executor.submit_score(task), gate, rt.group_timeout_s,
                                per_completion=rt.group_timeout_s is not None and rt.straggler_policy == "partial")
        self.executor = _make_executor(cfg, self.loop, self.inflight, backend)
        self._failure: Optional[BaseException] = None  # the first failure _check reported
        self._started = False
        self._window = None  # (wall, rollout busy, rollout wait) at the end of the last step
        self._tokens0 = 0    # rollout tokens generated before this window
        self._tokens_per_s = 0.0  # of the last window in which a generate call ended
        self._next_round = 1  # the rollout round after the newest one trained (resume: its seeds)

    def _probe(self) -> LogprobProbe:
        ids = self.tokenizer(PROBE_TEXT)["input_ids"] or [self.tokenizer.eos_token_id]
        tolerance = probe_tolerance(self.rt.probe_tolerance, self.cfg.model.dtype)
        return LogprobProbe(ids, self.cfg.rollout.temperature, tolerance,
                            chunk_tokens=self.cfg.actor.logprob_chunk_tokens, seed=self.cfg.seed)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._window = (time.perf_counter(), self.loop.busy_seconds, self.loop.wait_seconds)
            self.executor.start()

    def close(self, abandon: bool = False) -> None:
        """Stop the rollout side. ``abandon`` (a preempted run): generations in flight are
        not waited for — their groups were never trained and a resume regenerates them
        (resume.py) — so the rollout process is stopped within seconds."""
        timeout = 5.0 if abandon else 30.0
        try:
            if abandon:  # no restart of a child killed on purpose
                setattr(self.backend, "closing", True)
            if self._started:
                self.executor.stop(timeout)
            # the last deferred probe; after a reported failure (e.g. a dead rollout process)
            # its pending load failed for the same cause: not raised again
            self.weight_sync.close(raise_pending=self._failure is None and not abandon, model=self.actor.model)
        finally:
            close = getattr(self.backend, "close", None)
            if close is not None:  # a rollout process is stopped here
                close(timeout) if abandon else close()

    def step(self, step: int) -> dict[str, float]:
        self.start()
        t = self.timer
        t.start_step()
        t.step_seconds.update(wait_rollout=0.0, weight_sync=0.0)
        with t.stage("wait_rollout"):
            deadline = Deadline(f"rollout data for step {step} ({self.batch_groups} groups)", self.rt.hang_timeout_s,
                                hint="the rollout side is alive but produced no batch")
            groups = self.buffer.take(self.batch_groups, check=lambda: (self._check(), deadline.check()))
        self._next_round = max(self._next_round, 1 + max(g.round_index for g in groups))
        with t.stage("reward"):
            scored = _as_scored_groups(groups)
            batch = build_train_batch(scored.outputs, scored.flat("scores"), self.tokenizer.pad_token_id)
            metrics = {**self._reward_metrics(scored), **staleness_metrics(
                self.actor.version, batch.token_versions, self.rt.max_staleness, self.backend.version)}
        with t.stage("old_logprobs"):
            self.old_logprobs(batch)
        with t.stage("ref_logprobs"):
            self.ref_logprobs(batch)
        with t.stage("reward"):
            metrics.update(self.token_rewards(batch))
            self.values(batch)
            self.advantages(batch)
        with t.stage("weight_sync"):  # the last push's overlapped probe, while the weights are still its
            metrics.update(self.weight_sync.finish_probe(self.actor.model))
        with t.stage("actor_update"):
            metrics.update(self.actor.update(batch))
        with t.stage("critic_update"):
            metrics.update(self.critic.update(batch) if self.critic is not None else {})
        if self.actor.version % self.rt.sync_every == 0:
            with t.stage("weight_sync"):
                metrics.update(self.weight_sync.push(self.actor.model, self.actor.version))
        self.last_samples = SampleStats.from_batch(batch)
        return {**metrics, **self._batch_metrics(batch, scored), **t.step_metrics(), **self.memory.step_metrics(),
                **self._overlap_metrics(), **self._fleet_metrics()}

    def _fleet_metrics(self) -> dict[str, float]:
        """Per-replica metrics of a fleet backend (rollout/fleet.py), else none."""
        step_metrics = getattr(self.backend, "step_metrics", None)
        return step_metrics() if step_metrics is not None else {}

    def _check(self) -> None:
        """While the trainer waits for data: a failed rollout side or weight load raises (and
        is remembered, so ``close`` does not raise its consequences a second time)."""
        try:
            self.executor.check()
            self.weight_sync.check()
        except BaseException as err:
            self._failure = err
            raise

    # resume (resume.py): in-flight groups are regenerated, see its module doc ----------------

    def data_position(self) -> int:
        """Prompts of the groups trained or released so far: group g is prompt start + g, and
        every id below the buffer's cursor was trained or released, none above it trained."""
        return getattr(self.prompts, "start", 0) + self.buffer.cursor

    def state_dict(self) -> dict:
        return {**super().state_dict(), "next_round": self._next_round}

    def load_state_dict(self, state: dict) -> None:
        """Before ``start``: the rollout backend gets the resumed weights, admission restarts
        at their version, and rollout rounds (seeds) continue after the last trained one."""
        if self._started:
            raise RuntimeError("load_state_dict must come before the first step")
        super().load_state_dict(state)
        self.staleness.resume_at(self.actor.version)
        self._next_round = state.get("next_round", 1)
        self.loop.resume_rounds(self._next_round)

    def sync_weights(self) -> None:
        """The rollout backend holds its own copy: copy the trainer's weights into it (LoRA: the
        adapters, or the merged layers for an engine serving the merged model; as a push does)."""
        self.backend.update_weights(rollout_weights(self.actor.model, self.backend), self.actor.version)

    def _rollout_tokens_per_s(self, tokens: int, rollout_seconds: float) -> float:
        """Tokens / generate seconds of the calls that ended in this window; a window in which
        none ended repeats the last value (0 would read as a throughput collapse)."""
        if rollout_seconds > 0:
            self._tokens_per_s = (tokens - self._tokens0) / rollout_seconds
        return self._tokens_per_s

    def _overlap_metrics(self) -> dict[str, float]:
        """Over the window since the last step ended: R = rollout busy (generate) seconds
        (``async/rollout_seconds``; ``time/rollout`` stays the trainer thread's, 0),
        T = trainer busy seconds = W − wait_rollout, overlap = (R + T − W) / min(R, T), the
        fraction of the shorter side hidden behind the other (1: perfect overlap)."""
        now, busy, wait = time.perf_counter(), self.loop.busy_seconds, self.loop.wait_seconds
        w0, b0, wt0 = self._window
        self._window = (now, busy, wait)
        wall, rollout = now - w0, busy - b0
        trainer = max(wall - self.timer.step_seconds["wait_rollout"], 0.0)
        shorter = min(rollout, trainer)
        overlap = (rollout + trainer - wall) / shorter if shorter > 0 else 0.0
        tokens = self.loop.generated_tokens
        metrics = {"async/rollout_seconds": rollout, "time/wait_trainer": wait - wt0, "async/overlap": min(max(overlap, 0.0), 1.0),
                   "async/window_seconds": wall, "async/trainer_busy_seconds": trainer,
                   "async/buffer_groups": float(len(self.buffer)), "async/running_groups": float(self.staleness.running),
                   "async/groups_timed_out": float(self.inflight.timed_out),
                   "async/groups_partial": float(self.inflight.partial),
                   "async/rollout_restarts": float(getattr(self.backend, "restarts", 0)),
                   "throughput/rollout_tokens_per_s": self._rollout_tokens_per_s(tokens, rollout)}
        self._tokens0 = tokens
        return metrics


def _announce_restart(restarts: int, reason: str) -> None:
    from asyncrl.metrics.console import console

    console.print(f"[bold yellow]rollout process restarted[/] ({restarts} so far): {reason}; its groups in flight "
                  "are generated again with the last pushed weights")


def _params(backend):
    model = getattr(backend, "model", None)
    return list(model.parameters()) if isinstance(model, torch.nn.Module) else []


def _as_scored_groups(groups: list[ScoredGroup]) -> ScoredGroups:
    return ScoredGroups([g.example for g in groups], [g.output for g in groups], [g.scores for g in groups],
                        [g.correct for g in groups], None)


def _make_executor(cfg, loop: RolloutLoop, inflight: InFlight, backend):
    rt = cfg.runtime
    if rt.executor == "ray":
        from asyncrl.runtime.executors.ray import RayExecutor

        return RayExecutor(loop, inflight, rt.rollout_workers, rt.reward_workers, backend.placement_group)
    from asyncrl.runtime.executors.local import LocalExecutor

    return LocalExecutor(loop, inflight, rt.rollout_workers, rt.reward_workers)
