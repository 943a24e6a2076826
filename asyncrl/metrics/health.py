"""Health monitors: loud warnings for the silent ways an RL run goes wrong.

Each monitor watches one failure, reads the step's metrics (the dict the controller
returns, plus ``eval/accuracy`` on eval steps), and fires a :class:`HealthEvent` when its
threshold in :class:`HealthConfig` is crossed. The :class:`HealthMonitor` runs them all::

    monitor = HealthMonitor(HealthConfig(), events_path=run_dir / "health_events.jsonl", mode="async")
    events = monitor.observe(step, metrics, samples=SampleStats.from_batch(batch))
    metrics.update(monitor.step_metrics())      # health/<name> 0/1, counters, derived
    monitor.warn(events, console)               # an episode's start and end, once each
    monitor.finish(console)                     # at the end: episodes still open, with counts

An *episode* is a run of steps in which one monitor keeps firing; the console prints it when
it starts and once when it ends (with its step count and worst value), not at every step.
Monitors know the run's ``mode``: in async runs the rollout/trainer log-prob gap includes the
expected policy lag, so ``logprob_gap`` reads the weight-sync probe (same weights on both sides).

A monitor whose input metric is absent stays silent and reports nothing (KL without a
reference model, staleness in synchronous mode), so one monitor set serves every runtime.

Monitors never stop the run: they tell. Detecting reward hacking from metrics is mostly
an audit after the fact (pytorch/rl#3984); the eval-based monitor is as early as the eval
cadence (``trainer.eval_every``) allows.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from asyncrl.config import HealthConfig  # the config section these monitors read


@dataclass
class HealthEvent:
    """One monitor firing at one step. ``value`` crossed ``threshold``."""

    step: int
    monitor: str
    message: str
    value: float
    threshold: float
    severity: str = "warning"

    def to_json(self) -> str:
        return json.dumps({k: _jsonable(v) for k, v in asdict(self).items()})


@dataclass
class SampleStats:
    """Per-sample data of one step, for monitors that need more than means.

    ``lengths``: response tokens per sample; ``rewards``: its score; ``group_ids``: the
    prompt it answers (the G samples of one prompt share an id), or None.
    """

    lengths: Sequence[float]
    rewards: Sequence[float]
    group_ids: Optional[Sequence[int]] = None

    @classmethod
    def from_batch(cls, batch) -> "SampleStats":
        """From a :class:`~asyncrl.types.TrainBatch` (``response_mask``, ``scores``, ``group_ids``)."""
        groups = getattr(batch, "group_ids", None)
        return cls(lengths=batch.response_mask.sum(-1).tolist(), rewards=batch.scores.tolist(),
                   group_ids=groups.tolist() if groups is not None else None)


def length_reward_correlation(lengths: Sequence[float], rewards: Sequence[float],
                              group_ids: Optional[Sequence[int]] = None) -> Optional[float]:
    """Pearson correlation of response length and reward, within groups when ids are given.

    Within-group (both centred on their group's mean) asks the question GRPO's advantage
    asks: among answers to the *same* prompt, are longer ones rewarded more? That removes
    the confound of hard prompts having both long answers and low reward.
    None when either side has no variance (e.g. every group degenerate).
    """
    x, y = [float(v) for v in lengths], [float(v) for v in rewards]
    if group_ids is not None:
        x, y = _centre_by_group(x, group_ids), _centre_by_group(y, group_ids)
    if len(x) < 2:
        return None
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx <= 1e-12 or syy <= 1e-12:
        return None
    return sxy / math.sqrt(sxx * syy)


def _centre_by_group(values: list[float], group_ids: Sequence[int]) -> list[float]:
    sums: dict = {}
    for v, g in zip(values, group_ids):
        total, count = sums.get(g, (0.0, 0))
        sums[g] = (total + v, count + 1)
    return [v - sums[g][0] / sums[g][1] for v, g in zip(values, group_ids)]


# ----------------------------------------------------------------------------- monitors


class Monitor:
    """Base: ``check`` returns (value, threshold, message) when firing, else None.

    ``active`` becomes True once the monitor has seen its input, so ``health/<name>`` is
    only reported for monitors that are actually watching something; ``checked`` is True
    when it saw its input in the current step (a step without input neither continues nor
    ends an episode). ``worse``: which direction of ``value`` is worse ("higher"/"lower").
    """

    name = "monitor"
    worse = "higher"

    def __init__(self, cfg: HealthConfig, mode: str = "sync"):
        self.cfg, self.mode = cfg, mode
        self.active = False
        self.checked = False

    def check(self, step: int, metrics: Mapping[str, float], samples: Optional[SampleStats]):
        raise NotImplementedError

    def value(self, metrics: Mapping[str, float], key: str) -> Optional[float]:
        """``metrics[key]`` as a float, marking the monitor active; None when absent."""
        if key not in metrics:
            return None
        self.active = self.checked = True
        return _as_float(metrics[key])


class KLBudget(Monitor):
    """KL to the reference beyond its budget: the policy drifted further than intended."""

    name = "kl_budget"

    def check(self, step, metrics, samples):
        kl = self.value(metrics, "kl/ref")
        if kl is not None and (kl > self.cfg.kl_budget or not math.isfinite(kl)):
            return kl, self.cfg.kl_budget, (f"KL to reference {kl:.4f} nats/token exceeds the budget "
                                            f"{self.cfg.kl_budget}: raise algorithm.kl_coef or lower actor.lr")


class RewardHacking(Monitor):
    """Train reward rising while held-out accuracy falls below its best.

    At each eval, compare with the eval where accuracy peaked: the reward (mean of the last
    ``window`` steps) must have risen by ``hacking_min_reward_rise`` while accuracy fell by
    ``hacking_min_accuracy_drop``, at ``hacking_patience`` consecutive evals: one eval of a
    few hundred prompts has a binomial noise of a few points, so one dip proves nothing.
    The value reported is the accuracy drop.
    """

    name = "reward_hacking"

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.rewards: deque[float] = deque(maxlen=cfg.window)
        self.best: Optional[tuple[float, float]] = None  # (accuracy, reward window mean) at best eval
        self.strikes = 0  # consecutive evals that met both conditions

    def check(self, step, metrics, samples):
        reward = _as_float(metrics.get("reward/mean"))
        if reward is not None and math.isfinite(reward):
            self.rewards.append(reward)
        accuracy = self.value(metrics, "eval/accuracy")
        if accuracy is None or not self.rewards:
            return None
        reward_now = sum(self.rewards) / len(self.rewards)
        if self.best is None or accuracy >= self.best[0]:
            self.best, self.strikes = (accuracy, reward_now), 0
            return None
        drop, rise = self.best[0] - accuracy, reward_now - self.best[1]
        hacked = drop >= self.cfg.hacking_min_accuracy_drop and rise >= self.cfg.hacking_min_reward_rise
        self.strikes = self.strikes + 1 if hacked else 0
        if self.strikes >= self.cfg.hacking_patience:
            return drop, self.cfg.hacking_min_accuracy_drop, (
                f"possible reward hacking: train reward +{rise:.3f} while held-out accuracy "
                f"-{drop:.3f} since its best ({self.best[0]:.3f}), {self.strikes} evals in a row; "
                "inspect samples and the reward function")


class Staleness(Monitor):
    """Samples trained beyond the staleness bound (counted by the async runtime)."""

    name = "staleness"

    def check(self, step, metrics, samples):
        violations = self.value(metrics, "async/staleness_violations")
        if violations is not None and violations > 0:
            return violations, 0.0, (f"{violations:g} samples trained beyond runtime.max_staleness: "
                                     "the staleness bound is not being enforced")


class VersionLag(Monitor):
    """The rollout engine's weights lag the trainer by more than allowed versions."""

    name = "version_lag"

    def check(self, step, metrics, samples):
        lag = self.value(metrics, "async/version_lag")
        if lag is not None and lag > self.cfg.max_version_lag:
            return lag, float(self.cfg.max_version_lag), (
                f"rollout weights are {lag:g} versions behind the trainer (allowed "
                f"{self.cfg.max_version_lag}): weight sync is slow or stuck")


class DropMonitor(Monitor):
    """A rate falling below ``(1 - drop)`` of its best sustained level, and staying there.

    Baseline: the best median of ``window`` consecutive steps after ``warmup_steps``; now:
    the median of the last ``window`` steps. It fires once ``now`` has stayed below the floor
    for ``drop_patience`` consecutive steps: medians and patience keep a transient slowdown
    (another process taking the CPU for a few steps) from crying wolf.
    """

    key = ""
    drop_field = ""
    what = ""
    causes = ""
    worse = "lower"

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.recent: deque[float] = deque(maxlen=max(cfg.window, 1))
        self.best = 0.0
        self.seen = 0
        self.below = 0  # consecutive steps with the median under the floor

    def check(self, step, metrics, samples):
        value = self.value(metrics, self.key)
        if value is None or not math.isfinite(value):
            return None
        self.seen += 1
        self.recent.append(value)
        if self.seen <= self.cfg.warmup_steps or len(self.recent) < self.recent.maxlen:
            return None
        now = statistics.median(self.recent)
        drop = getattr(self.cfg, self.drop_field)
        floor = (1.0 - drop) * self.best
        self.best = max(self.best, now)
        self.below = self.below + 1 if now < floor else 0
        if self.below >= self.cfg.drop_patience:
            return now, floor, (f"{self.what} dropped to {now:.4g} (median of {len(self.recent)} steps) for "
                                f"{self.below} steps, below {floor:.4g} = {1 - drop:.0%} of its best "
                                f"{self.best:.4g}: {self.causes}")


class ThroughputDrop(DropMonitor):
    name, key, drop_field, what = "throughput_drop", "throughput/rollout_tokens_per_s", "throughput_drop", "rollout tokens/s"
    causes = ("another process competing for the CPU/GPU, memory pressure (KV cache preemption), "
              "or a slower engine path (CUDA graphs off, cache misses)")


class PrefixCacheDrop(DropMonitor):
    name, key, drop_field, what = ("prefix_cache_drop", "engine/prefix_cache_hit_rate", "prefix_cache_drop",
                                   "prefix-cache hit rate")
    causes = "the G samples of a prompt no longer share its KV blocks (evictions, or prompts split across engines)"


class DegenerateGroups(Monitor):
    """Most groups have all-equal rewards, so zero advantage: the step learns (almost) nothing."""

    name = "degenerate_groups"

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.recent: deque[float] = deque(maxlen=max(cfg.window, 1))

    def check(self, step, metrics, samples):
        fraction = self.value(metrics, "groups/degenerate_fraction")
        if fraction is None:
            return None
        self.recent.append(fraction)
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) == self.recent.maxlen and mean > self.cfg.degenerate_max:
            return mean, self.cfg.degenerate_max, (
                f"{mean:.0%} of groups have all-equal rewards (zero advantage) over {len(self.recent)} steps: "
                "prompts are too easy or too hard; filter them (dynamic sampling) or raise rollout.n")


class _EntropyBaseline(Monitor):
    """Shared: the warm-up entropy (mean of the first ``warmup_steps`` finite values)."""

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.warmup: list[float] = []

    def entropy(self, metrics) -> tuple[Optional[float], Optional[float]]:
        """(entropy now, baseline or None while warming up)."""
        entropy = self.value(metrics, "actor/entropy")
        if entropy is None or not math.isfinite(entropy):
            return None, None
        if len(self.warmup) < max(self.cfg.warmup_steps, 1):
            self.warmup.append(entropy)
            return entropy, None
        return entropy, sum(self.warmup) / len(self.warmup)


class EntropyCollapse(_EntropyBaseline):
    """Policy entropy near zero: the policy became deterministic and stops exploring."""

    name = "entropy_collapse"
    worse = "lower"

    def check(self, step, metrics, samples):
        entropy, baseline = self.entropy(metrics)
        if entropy is None:
            return None
        floor = self.cfg.entropy_floor
        if baseline is not None:
            floor = max(floor, self.cfg.entropy_collapse_ratio * baseline)
        if entropy < floor:
            return entropy, floor, (f"entropy collapsed to {entropy:.4f} nats/token (floor {floor:.4f}): "
                                    "raise temperature, clip_ratio_high or algorithm.entropy_coeff")


class EntropyBlowup(_EntropyBaseline):
    """Policy entropy far above its start: the policy is diverging into noise."""

    name = "entropy_blowup"

    def check(self, step, metrics, samples):
        entropy, baseline = self.entropy(metrics)
        if entropy is None or baseline is None:
            return None
        ceiling = self.cfg.entropy_blowup_ratio * baseline
        if entropy > ceiling:
            return entropy, ceiling, (f"entropy blew up to {entropy:.3f} nats/token ({entropy / baseline:.1f}x the "
                                      "warm-up value): lower actor.lr or check the loss for a sign error")


class LengthHacking(Monitor):
    """Reward correlated with response length within groups (length hacking).

    Pools the (length, reward, group) samples of the last ``window`` steps, or reads a
    ``reward/length_corr`` metric when the caller computed it. Fires above ``length_corr_max``.
    """

    name = "length_hacking"

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.pool: deque[tuple[list, list, list]] = deque(maxlen=max(cfg.window, 1))
        self.last_corr: Optional[float] = None

    def check(self, step, metrics, samples):
        corr = self._pooled_corr(step, samples) if samples is not None else self.value(metrics, "reward/length_corr")
        self.last_corr = corr
        if corr is not None and corr > self.cfg.length_corr_max:
            return corr, self.cfg.length_corr_max, (
                f"reward correlates with response length (r={corr:.2f} within groups): the policy may be "
                "rewarded for length; check the reward and the loss aggregation (token-mean dilutes long answers)")

    def _pooled_corr(self, step, samples: SampleStats) -> Optional[float]:
        self.active = self.checked = True
        groups = list(samples.group_ids) if samples.group_ids is not None else [0] * len(samples.lengths)
        # Group ids restart each step: tag them with the step so pooled groups stay distinct.
        self.pool.append((list(samples.lengths), list(samples.rewards), [(step, g) for g in groups]))
        lengths = [v for item in self.pool for v in item[0]]
        if len(lengths) < self.cfg.length_min_samples:
            return None
        rewards = [v for item in self.pool for v in item[1]]
        ids = [g for item in self.pool for g in item[2]]
        return length_reward_correlation(lengths, rewards, ids if samples.group_ids is not None else None)


class NonFinite(Monitor):
    """NaN/Inf in the loss or gradients; the actor skipped the optimizer step."""

    name = "nonfinite"
    keys = ("actor/skipped_step", "actor/nonfinite_loss")

    def check(self, step, metrics, samples):
        flags = [self.value(metrics, k) for k in self.keys]
        bad = [k for k, v in zip(self.keys, flags) if v is not None and v != 0]
        bad += [k for k in ("actor/pg_loss", "actor/grad_norm") if k in metrics and not _finite(metrics[k])]
        if bad:
            return 1.0, 0.0, f"non-finite loss or gradient ({', '.join(bad)}): the optimizer step was skipped"


class LogprobGap(Monitor):
    """Rollout engine and trainer disagree on the sampled tokens' log-probs under the same weights.

    Sync: ``rollout/logprob_gap`` compares them on the step's own samples (same weights).
    Async: those samples come from weights up to ``max_staleness`` versions old, so that gap
    includes the policy's own drift, which the off-policy correction is there for; the
    monitor reads ``weight_sync/probe_gap`` instead, the probe that samples the rollout
    backend right after a sync and recomputes with the trainer (same weights on both sides).
    """

    name = "logprob_gap"

    def check(self, step, metrics, samples):
        key = "weight_sync/probe_gap" if self.mode == "async" else "rollout/logprob_gap"
        gap = self.value(metrics, key)
        if gap is not None and (gap > self.cfg.logprob_gap_max or not math.isfinite(gap)):
            return gap, self.cfg.logprob_gap_max, (
                f"rollout vs trainer log-prob gap {gap:.4f} nats/token ({key}, max {self.cfg.logprob_gap_max}) "
                "under the same weights: engine and trainer numerics or weights differ; check weight sync and dtypes")


class RolloutRestarts(Monitor):
    """The rollout process died and was restarted (``async/rollout_restarts`` rose): the run
    goes on, but a process that keeps dying (OOM, a crashing kernel) needs a look."""

    name = "rollout_restarts"

    def __init__(self, cfg, mode: str = "sync"):
        super().__init__(cfg, mode)
        self.seen = 0.0

    def check(self, step, metrics, samples):
        restarts = self.value(metrics, "async/rollout_restarts")
        if restarts is not None and restarts < self.seen:  # a resumed run counts from 0 again
            self.seen = 0.0
        if restarts is None or restarts <= self.seen:
            return None
        new, self.seen = restarts - self.seen, restarts
        return restarts, 0.0, (f"the rollout process died and was restarted ({new:g} this step, {restarts:g} in "
                               "all; runtime.max_restarts bounds them): its groups in flight were generated again")


MONITORS = (KLBudget, RewardHacking, Staleness, VersionLag, ThroughputDrop, PrefixCacheDrop, DegenerateGroups,
            EntropyCollapse, EntropyBlowup, LengthHacking, NonFinite, LogprobGap, RolloutRestarts)


# ----------------------------------------------------------------------------- runner


@dataclass
class Episode:
    """Consecutive steps in which one monitor fired: first/last step, count, worst value."""

    monitor: str
    first: int
    last: int
    count: int
    worst: float
    threshold: float
    message: str  # the first event's

    def add(self, event: HealthEvent, worse: str) -> None:
        self.last, self.count = event.step, self.count + 1
        self.worst = _worst(self.worst, event.value, worse)

    def ended_line(self) -> str:
        return (f"[bold yellow]health[/] [yellow]{self.monitor}[/] fired {self.count} step(s), steps "
                f"{self.first}-{self.last}, worst {self.worst:.4g} (threshold {self.threshold:.4g})")


@dataclass
class HealthMonitor:
    """Runs every monitor each step, counts firings, logs events and prints each episode once.

    ``events_path``: where events are appended as JSON lines (``health_events.jsonl``);
    None keeps them in memory only (``self.events``). ``mode``: the run's ``runtime.mode``.
    Invariant: every event belongs to exactly one :class:`Episode` (open in ``self.open`` or
    closed in ``self.closed``); an episode is printed when it opens and when it closes.
    """

    cfg: HealthConfig = field(default_factory=HealthConfig)
    events_path: Optional[Path] = None
    mode: str = "sync"

    def __post_init__(self):
        self.monitors = [cls(self.cfg, self.mode) for cls in MONITORS]
        self.counts: dict[str, int] = {m.name: 0 for m in self.monitors}
        self.events: list[HealthEvent] = []
        self.firing: dict[str, bool] = {}
        self.open: dict[str, Episode] = {}
        self.closed: list[Episode] = []
        self._ended: list[Episode] = []  # closed in the last observe, not yet printed
        self._length_corr: Optional[float] = None
        self._kl: Optional[float] = None

    def observe(self, step: int, metrics: Mapping[str, float],
                samples: Optional[SampleStats] = None) -> list[HealthEvent]:
        """Check one step; returns the events fired (also kept in ``self.events`` and logged)."""
        if not self.cfg.enabled:
            return []
        events = []
        for monitor in self.monitors:
            monitor.checked = False
            result = monitor.check(step, metrics, samples)
            self.firing[monitor.name] = result is not None
            if result is not None:
                value, threshold, message = result
                events.append(HealthEvent(step, monitor.name, message, float(value), float(threshold)))
                self.counts[monitor.name] += 1
                self._extend_episode(events[-1], monitor.worse)
            elif monitor.checked and monitor.name in self.open:  # watched and quiet: the episode ended
                self._ended.append(self.open.pop(monitor.name))
                self.closed.append(self._ended[-1])
        self._length_corr = next(m.last_corr for m in self.monitors if isinstance(m, LengthHacking))
        self._kl = _as_float(metrics.get("kl/ref"))
        self.events.extend(events)
        self._append(events)
        return events

    def _extend_episode(self, event: HealthEvent, worse: str) -> None:
        episode = self.open.get(event.monitor)
        if episode is None:
            self.open[event.monitor] = Episode(event.monitor, event.step, event.step, 1, event.value,
                                               event.threshold, event.message)
        else:
            episode.add(event, worse)

    def step_metrics(self) -> dict[str, float]:
        """The health metrics of the last observed step.

        ``health/<name>`` (1 when firing this step) and ``health/<name>_count`` (steps fired so
        far) for each monitor that has seen its input; ``health/events_total``; and derived
        values: ``health/kl_budget_used`` (kl/ref / kl_budget) and ``reward/length_corr``
        (pooled within-group correlation, when samples are passed).
        """
        metrics: dict[str, float] = {}
        for monitor in self.monitors:
            if monitor.active:
                metrics[f"health/{monitor.name}"] = float(self.firing.get(monitor.name, False))
                metrics[f"health/{monitor.name}_count"] = float(self.counts[monitor.name])
        metrics["health/events_total"] = float(sum(self.counts.values()))
        if self._kl is not None and self.cfg.kl_budget > 0:
            metrics["health/kl_budget_used"] = self._kl / self.cfg.kl_budget
        if self._length_corr is not None:
            metrics["reward/length_corr"] = self._length_corr
        return metrics

    def episodes(self) -> list[Episode]:
        """Every episode so far (closed and still open), by first step."""
        return sorted([*self.closed, *self.open.values()], key=lambda e: (e.first, e.monitor))

    def summary(self) -> dict:
        """JSON-ready for summary.json: ``events`` (total), ``fired`` ({monitor: steps fired}) and
        ``monitors``: one row per monitor that fired (see :func:`group_events`)."""
        return {"events": sum(self.counts.values()), "fired": {k: v for k, v in self.counts.items() if v},
                "monitors": group_events(self.events)}

    def warn(self, events: Sequence[HealthEvent], console=None) -> list[HealthEvent]:
        """Print the start of each new episode (its first event's message), and the end of
        each episode that closed at this step (steps fired, worst value). With
        ``health.repeat_every`` > 0 an open episode is also re-printed every that many steps.
        Returns the events printed."""
        console = console or _console()
        for episode in self._ended:
            console.print(episode.ended_line() + f"; quiet from step {episode.last + 1}")
        self._ended = []
        printed = []
        for event in events:
            episode = self.open[event.monitor]
            again = self.cfg.repeat_every and episode.count > 1 and (episode.count - 1) % self.cfg.repeat_every == 0
            if episode.count == 1 or again:
                so_far = f" (firing for {episode.count} steps)" if episode.count > 1 else ""
                console.print(f"[bold yellow]health[/] step {event.step} [yellow]{event.monitor}[/]{so_far}: "
                              f"{event.message}")
                printed.append(event)
        return printed

    def finish(self, console=None) -> list[Episode]:
        """At the end of a run: print each episode still open with its count; returns them."""
        console = console or _console()
        still = list(self.open.values())
        for episode in still:
            console.print(episode.ended_line() + "; still firing at the end of the run")
        return still

    def _append(self, events: Sequence[HealthEvent]) -> None:
        if self.events_path is None or not events:
            return
        with open(self.events_path, "a") as f:
            for event in events:
                f.write(event.to_json() + "\n")


#: Which direction of a monitor's value is worse, by monitor name.
WORSE = {cls.name: cls.worse for cls in MONITORS}


def group_events(events: Sequence[HealthEvent]) -> list[dict]:
    """One row per monitor that fired, in order of first firing: ``monitor``, ``first`` and
    ``last`` step, ``steps`` fired, ``episodes`` (runs of consecutive firings), ``worst``
    value, ``threshold`` and the first ``message``. The report's health table and
    summary.json's ``health.monitors`` are these rows."""
    rows: dict[str, dict] = {}
    for event in sorted(events, key=lambda e: e.step):
        row = rows.get(event.monitor)
        if row is None:
            rows[event.monitor] = {"monitor": event.monitor, "first": event.step, "last": event.step, "steps": 1,
                                   "episodes": 1, "worst": event.value, "threshold": event.threshold,
                                   "message": event.message}
            continue
        row["episodes"] += event.step - row["last"] > 1
        row["last"], row["steps"] = event.step, row["steps"] + 1
        row["worst"] = _worst(row["worst"], event.value, WORSE.get(event.monitor, "higher"))
    return [{k: _jsonable(v) for k, v in row.items()} for row in rows.values()]


def _worst(a: float, b: float, worse: str) -> float:
    if not math.isfinite(b):
        return b
    if not math.isfinite(a):
        return a
    return max(a, b) if worse == "higher" else min(a, b)


def _console():
    from asyncrl.metrics.console import console
    return console


def replay(rows, cfg: Optional[HealthConfig] = None) -> HealthMonitor:
    """Run the monitors over logged metrics.jsonl rows (no per-sample data: ``length_hacking``
    then sees only a logged ``reward/length_corr``). For runs logged without the monitor, and
    for checking a finished run against other thresholds."""
    monitor = HealthMonitor(cfg or HealthConfig())
    for row in rows:
        monitor.observe(int(row.get("step", 0)), row)
    return monitor


def read_events(path: Path) -> list[HealthEvent]:
    """Load ``health_events.jsonl`` (missing file: no events)."""
    path = Path(path)
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row["value"], row["threshold"] = float(row["value"]), float(row["threshold"])  # "nan" -> nan
            events.append(HealthEvent(**row))
    return events


def _as_float(value) -> Optional[float]:
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    try:
        return float(value)  # also parses the "nan"/"inf" strings the JSONL sink writes
    except (TypeError, ValueError):
        return None


def _finite(value) -> bool:
    number = _as_float(value)
    return number is not None and math.isfinite(number)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
