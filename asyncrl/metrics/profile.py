"""Stage profile: where a step's time goes, and what speeding up one stage would buy.

Inputs are the stage seconds the :class:`~asyncrl.metrics.timer.StageTimer` measures
(``time/<stage>`` per step). From them this module derives:

- the per-step and cumulative share of each stage;
- the Amdahl projection: if stage ``s`` takes the fraction ``p`` of a serial step and
  becomes ``k`` times faster, the step becomes ``1 / ((1 - p) + p / k)`` times faster
  (at most ``1 / (1 - p)``, however fast the stage gets);
- in asynchronous mode, where rollout and training run concurrently as two *lanes*, the
  overlap achieved: ``hidden = sum(stage seconds) - wall seconds`` of work ran in parallel,
  out of at most ``sum - max(lane sums)`` that perfect overlap would hide;
- tokens/s of rollout (generated tokens / rollout seconds) and of training (trained
  tokens / seconds of the trainer stages).

Stages whose name ends in ``_wait`` (``rollout_wait``, ``trainer_wait``: a loop idling on
the other) are reported but never projected: waiting is an outcome of the other stages,
not work that can be made faster.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from rich.table import Table

#: Stages run by the trainer (their seconds are the denominator of training tokens/s).
TRAIN_STAGES = ("old_logprobs", "ref_logprobs", "actor_update", "critic_update")
#: The two lanes of the asynchronous runtime; anything else (weight_sync) is serial.
ASYNC_LANES = {"rollout": ("rollout", "reward"), "train": TRAIN_STAGES}
#: Speed-up factors shown in the Amdahl table (``inf``: the stage takes no time at all).
DEFAULT_FACTORS = (2.0, 5.0, float("inf"))


def is_wait(stage: str) -> bool:
    """True for idle time (``*_wait``), which is shown but not projected."""
    return stage.endswith("_wait")


def project_seconds(stage_seconds: Mapping[str, float], speedups: Mapping[str, float],
                    lanes: Optional[Mapping[str, Iterable[str]]] = None) -> float:
    """Step seconds after dividing each stage's time by its factor in ``speedups``.

    Serial model (``lanes=None``): the step is the sum of its work stages.
    Lane model: each lane runs its stages in sequence, lanes run concurrently, and stages in
    no lane (e.g. ``weight_sync``) are serial: ``max(lane sums) + sum(other stages)``.
    ``*_wait`` stages are dropped in both models (they are the result, not a cause).
    """
    scaled = {s: t / speedups.get(s, 1.0) for s, t in stage_seconds.items() if not is_wait(s)}
    if not lanes:
        return sum(scaled.values())
    in_lane = {s for stages in lanes.values() for s in stages}
    lane_sums = [sum(scaled.get(s, 0.0) for s in stages) for stages in lanes.values()]
    return max(lane_sums, default=0.0) + sum(t for s, t in scaled.items() if s not in in_lane)


def amdahl_speedup(stage_seconds: Mapping[str, float], stage: str, factor: float,
                   lanes: Optional[Mapping[str, Iterable[str]]] = None) -> float:
    """Whole-step speed-up when ``stage`` becomes ``factor`` times faster (``inf`` allowed)."""
    before = project_seconds(stage_seconds, {}, lanes)
    after = project_seconds(stage_seconds, {stage: factor}, lanes)
    if after <= 0.0:
        return float("inf")
    return before / after


def amdahl_table(stage_seconds: Mapping[str, float], factors: Iterable[float] = DEFAULT_FACTORS,
                 lanes: Optional[Mapping[str, Iterable[str]]] = None) -> dict[str, dict[str, float]]:
    """``{stage: {"2x": speedup, "5x": ..., "inf": ...}}`` for every work stage with time > 0."""
    factors = tuple(factors)
    return {stage: {factor_label(k): amdahl_speedup(stage_seconds, stage, k, lanes) for k in factors}
            for stage, seconds in stage_seconds.items() if seconds > 0 and not is_wait(stage)}


def factor_label(factor: float) -> str:
    """``2.0 -> "2x"``, ``inf -> "inf"`` (the keys used in summary.json)."""
    return "inf" if factor == float("inf") else f"{factor:g}x"


def overlap(stage_seconds: Mapping[str, float], wall_seconds: float,
            lanes: Mapping[str, Iterable[str]] = ASYNC_LANES) -> dict[str, float]:
    """Overlap achieved by the asynchronous runtime over some span of wall time.

    ``overlap`` = hidden / work: the fraction of the work time that ran concurrently.
    ``overlap_efficiency`` = hidden / hideable, where hideable = work - ideal lane-model time:
    1.0 means the lanes overlapped perfectly; 0.0 means they ran one after another.
    """
    work = sum(t for s, t in stage_seconds.items() if not is_wait(s))
    hidden = max(work - wall_seconds, 0.0)
    hideable = work - project_seconds(stage_seconds, {}, lanes)
    return {"overlap": hidden / work if work > 0 else 0.0,
            "overlap_efficiency": min(hidden / hideable, 1.0) if hideable > 0 else 0.0}


@dataclass
class StageProfile:
    """Cumulative stage profile of a run, fed one step at a time.

    ``observe`` takes the step's stage seconds (``StageTimer.step_seconds``), and optionally
    the step's wall seconds (asynchronous mode: less than the stage sum when lanes overlap),
    the number of generated tokens and of tokens the trainer processed.
    """

    lanes: Optional[dict[str, tuple[str, ...]]] = None
    factors: tuple[float, ...] = DEFAULT_FACTORS
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_seconds: float = 0.0
    steps: int = 0
    rollout_tokens: float = 0.0
    rollout_seconds: float = 0.0  # generation busy time (async: the rollout lane's, not a trainer stage)
    train_tokens: float = 0.0

    def observe(self, step_seconds: Mapping[str, float], wall_seconds: Optional[float] = None,
                rollout_tokens: float = 0.0, train_tokens: Optional[float] = None,
                rollout_seconds: Optional[float] = None) -> dict[str, float]:
        """Add one step; returns that step's derived metrics (see docs/metrics.md).

        ``train_tokens`` defaults to ``rollout_tokens`` (every generated token is trained on);
        ``rollout_seconds`` (the time that generated ``rollout_tokens``) to the rollout stage's.
        """
        work = sum(t for s, t in step_seconds.items() if not is_wait(s))
        wall = work if wall_seconds is None else wall_seconds
        train_tokens = rollout_tokens if train_tokens is None else train_tokens
        for stage, seconds in step_seconds.items():
            self.stage_seconds[stage] += seconds
        self.wall_seconds += wall
        self.steps += 1
        self.rollout_tokens += rollout_tokens
        self.rollout_seconds += step_seconds.get("rollout", 0.0) if rollout_seconds is None else rollout_seconds
        self.train_tokens += train_tokens
        metrics = {"throughput/train_tokens_per_s": _rate(train_tokens, _train_seconds(step_seconds))}
        if self.lanes:
            metrics.update({f"async/{k}": v for k, v in overlap(step_seconds, wall, self.lanes).items()})
        return metrics

    def amdahl(self) -> dict[str, dict[str, float]]:
        """The Amdahl table over the cumulative stage seconds."""
        return amdahl_table(self.stage_seconds, self.factors, self.lanes)

    def summary(self) -> dict:
        """A JSON-ready dict for ``summary.json["profile"]``."""
        total = sum(self.stage_seconds.values())
        out = {
            "steps": self.steps,
            "wall_seconds": self.wall_seconds,
            "step_seconds_mean": self.wall_seconds / self.steps if self.steps else 0.0,
            "stage_seconds": dict(self.stage_seconds),
            "stage_share": {s: t / total if total > 0 else 0.0 for s, t in self.stage_seconds.items()},
            "amdahl": self.amdahl(),
            "tokens_per_s": {"rollout": _rate(self.rollout_tokens, self.rollout_seconds),
                             "train": _rate(self.train_tokens, _train_seconds(self.stage_seconds))},
        }
        if self.lanes:
            out["async"] = overlap(self.stage_seconds, self.wall_seconds, self.lanes)
        return out


def profile_from_rows(rows: Iterable[Mapping], lanes: Optional[dict] = None) -> StageProfile:
    """Rebuild a profile from metrics.jsonl rows (``time/<stage>`` keys), e.g. for the report.

    Generated tokens per step are recovered as ``throughput/rollout_tokens_per_s *
    time/rollout`` (the controller computes the former from the latter). Wall seconds come
    from ``time/wall`` when the async runtime logs it, else the stage sum.
    """
    profile = StageProfile(lanes=lanes)
    for row in rows:
        stages = {k[5:]: float(v) for k, v in row.items()
                  if k.startswith("time/") and k not in ("time/step", "time/wall") and _is_number(v)}
        if not stages:
            continue
        tokens = float(row.get("throughput/rollout_tokens_per_s", 0.0) or 0.0) * stages.get("rollout", 0.0)
        wall = row.get("time/wall")
        profile.observe(stages, float(wall) if _is_number(wall) else None, rollout_tokens=tokens)
    return profile


def profile_table(profile: StageProfile, title: str = "stage profile") -> Table:
    """A rich table: seconds and share per stage, mean per step, and the Amdahl columns
    (whole-step speed-up if that stage alone became 2x, 5x faster, or free)."""
    summary = profile.summary()
    labels = [factor_label(k) for k in profile.factors]
    table = Table(title=f"{title} (step speed-up if the stage gets k times faster)", show_header=True)
    for name in ("stage", "total s", "share", "s/step", *(label if label != "inf" else "free" for label in labels)):
        table.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    amdahl = summary["amdahl"]
    for stage, seconds in sorted(summary["stage_seconds"].items(), key=lambda kv: -kv[1]):
        speedups = [f"{amdahl[stage][label]:.2f}x" if stage in amdahl else "-" for label in labels]
        table.add_row(stage, f"{seconds:.2f}", f"{100 * summary['stage_share'][stage]:.1f}%",
                      f"{seconds / max(profile.steps, 1):.3f}", *speedups)
    tps = summary["tokens_per_s"]
    table.caption = f"rollout {tps['rollout']:.0f} tok/s · train {tps['train']:.0f} tok/s"
    if "async" in summary:
        table.caption += f" · overlap {100 * summary['async']['overlap']:.0f}%"
    return table


def headline(profile: StageProfile, factor: float = 5.0) -> str:
    """One sentence naming the bottleneck, e.g. ``rollout is 64% of the step: 5x faster
    rollout -> step 2.05x faster (at most 2.78x)``."""
    summary = profile.summary()
    amdahl = summary["amdahl"]
    if not amdahl:
        return "no stage time recorded"
    stage = max(amdahl, key=lambda s: summary["stage_seconds"][s])
    share = summary["stage_share"][stage]
    fast = amdahl_speedup(profile.stage_seconds, stage, factor, profile.lanes)
    limit = amdahl_speedup(profile.stage_seconds, stage, float("inf"), profile.lanes)
    return (f"{stage} is {100 * share:.0f}% of the step: {factor:g}x faster {stage} -> step "
            f"{fast:.2f}x faster (at most {limit:.2f}x)")


def _train_seconds(stage_seconds: Mapping[str, float]) -> float:
    return sum(stage_seconds.get(s, 0.0) for s in TRAIN_STAGES)


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
