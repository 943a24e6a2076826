"""Stage profile: where a run's time goes, and what speeding up one stage would buy.

The single source of truth for every stage figure a user reads: the console's tables, the
``profile`` block of ``summary.json`` and the report page all come from one
:class:`StageProfile`, fed with :meth:`StepTimes.from_row` of the very metrics row written to
``metrics.jsonl``. A report rebuilt from ``metrics.jsonl`` alone therefore shows the same
numbers as the run printed.

What a row says about time (``docs/metrics.md``):

- ``time/<stage>``: seconds of one stage of the step. Stages named ``wait_*`` are idle time
  (``wait_rollout``: the trainer waiting for a batch, async): shown, never projected, since
  waiting is an outcome of the other stages, not work that can be made faster.
  ``time/step`` (their sum) and ``time/wait_trainer`` (the rollout workers blocked on the
  staleness bound, summed over workers and concurrent with the step) are not stages.
- async runs also log ``async/rollout_seconds`` (generate time of the rollout lane in the
  window since the last step) and ``async/window_seconds`` (that window's wall time). The
  profile then reads the rollout lane's time as the ``rollout`` stage, and the part of the
  window the trainer spent outside ``controller.step`` (held-out eval, logging, checkpoints)
  as the ``between_steps`` stage, so the trainer lane adds up to the window.

Derived figures:

- shares: stage seconds / wall seconds. Sync: the step is the sum of its stages, so shares add
  to 100%. Async: the rollout lane and the trainer lane (its stages + ``wait_rollout``) run at
  the same time and each add up to about 100% of the wall time.
- Amdahl: if a stage takes the fraction ``p`` of a serial step and becomes ``k`` times faster,
  the step becomes ``1 / ((1 - p) + p / k)`` times faster (at most ``1 / (1 - p)``). Async:
  the step is ``max(rollout lane, trainer lane)``, so speeding up the shorter lane buys nothing.
- async overlap = ``(R + T - W) / min(R, T)``: the share of the shorter lane hidden behind the
  longer one (1: perfect overlap, 0: the lanes took turns), R = rollout lane seconds,
  T = trainer lane seconds, W = wall seconds. The controller logs the same quantity per step
  as ``async/overlap``; the profile's is over the whole run.
- tokens/s: rollout = generated tokens / rollout seconds; train = trained tokens / seconds of
  the trainer stages (old/ref log-probs, actor and critic update).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from rich.table import Table

#: Stages run by the trainer (their seconds are the denominator of training tokens/s).
TRAIN_STAGES = ("old_logprobs", "ref_logprobs", "actor_update", "critic_update")
#: async: the stages of the rollout lane; every other work stage runs on the trainer's thread.
ROLLOUT_LANE = ("rollout",)
#: ``time/<key>`` entries that are not stages of the step (see the module doc).
NOT_STAGES = ("step", "wall", "wait_trainer")
#: Speed-up factors shown in the Amdahl table (``inf``: the stage takes no time at all).
DEFAULT_FACTORS = (2.0, 5.0, float("inf"))


def is_wait(stage: str) -> bool:
    """True for idle time (``wait_rollout``), which is shown but never projected."""
    return stage.startswith("wait_")


def work_seconds(stage_seconds: Mapping[str, float]) -> dict[str, float]:
    """The stages that are work (every stage but the ``wait_*`` ones)."""
    return {s: t for s, t in stage_seconds.items() if not is_wait(s)}


def project_seconds(stage_seconds: Mapping[str, float], speedups: Mapping[str, float],
                    concurrent: bool = False) -> float:
    """Step seconds after dividing each work stage's time by its factor in ``speedups``.

    Serial (sync): the sum of the work stages. Concurrent (async): the rollout lane and the
    trainer lane (every other work stage) run at once: ``max(rollout lane, trainer lane)``.
    """
    scaled = {s: t / speedups.get(s, 1.0) for s, t in work_seconds(stage_seconds).items()}
    if not concurrent:
        return sum(scaled.values())
    rollout = sum(t for s, t in scaled.items() if s in ROLLOUT_LANE)
    return max(rollout, sum(t for s, t in scaled.items() if s not in ROLLOUT_LANE))


def amdahl_speedup(stage_seconds: Mapping[str, float], stage: str, factor: float, concurrent: bool = False) -> float:
    """Whole-step speed-up when ``stage`` becomes ``factor`` times faster (``inf`` allowed)."""
    before = project_seconds(stage_seconds, {}, concurrent)
    after = project_seconds(stage_seconds, {stage: factor}, concurrent)
    return before / after if after > 0 else float("inf")


def amdahl_table(stage_seconds: Mapping[str, float], factors: Iterable[float] = DEFAULT_FACTORS,
                 concurrent: bool = False) -> dict[str, dict[str, float]]:
    """``{stage: {"2x": speedup, "5x": ..., "inf": ...}}`` for every work stage with time > 0."""
    factors = tuple(factors)
    return {stage: {factor_label(k): amdahl_speedup(stage_seconds, stage, k, concurrent) for k in factors}
            for stage, seconds in work_seconds(stage_seconds).items() if seconds > 0}


def factor_label(factor: float) -> str:
    """``2.0 -> "2x"``, ``inf -> "inf"`` (the keys used in summary.json)."""
    return "inf" if factor == float("inf") else f"{factor:g}x"


def lane_overlap(rollout_seconds: float, trainer_seconds: float, wall_seconds: float) -> float:
    """``(R + T - W) / min(R, T)`` clipped to [0, 1]: the share of the shorter lane hidden."""
    shorter = min(rollout_seconds, trainer_seconds)
    if shorter <= 0:
        return 0.0
    return min(max((rollout_seconds + trainer_seconds - wall_seconds) / shorter, 0.0), 1.0)


@dataclass
class StepTimes:
    """What one metrics row says about time: the profile's only input.

    ``stage_seconds``: ``{stage: s}`` (async: ``rollout`` is the rollout lane's generate time and
    ``between_steps`` the trainer outside the step); ``wall_seconds``: the step's wall time;
    ``rollout_tokens`` generated and ``train_tokens`` trained in it; ``rollout_wait_seconds``:
    rollout workers blocked on the staleness bound (async only).
    """

    stage_seconds: dict[str, float]
    wall_seconds: float
    rollout_tokens: float = 0.0
    train_tokens: float = 0.0
    rollout_wait_seconds: float = 0.0
    concurrent: bool = False

    @classmethod
    def from_row(cls, row: Mapping) -> Optional["StepTimes"]:
        """Read a metrics row (the dict the pipeline logs); None when it has no stage times."""
        stages = {k[5:]: float(v) for k, v in row.items()
                  if k.startswith("time/") and k[5:] not in NOT_STAGES and _is_number(v)}
        if not stages:
            return None
        step_seconds = sum(stages.values())
        concurrent = _is_number(row.get("async/rollout_seconds"))
        wall = step_seconds
        if concurrent:
            stages["rollout"] = float(row["async/rollout_seconds"])
            window = row.get("async/window_seconds")
            wall = float(window) if _is_number(window) else step_seconds
            stages["between_steps"] = max(wall - step_seconds, 0.0)
        return cls(stages, wall,
                   rollout_tokens=_number(row.get("throughput/rollout_tokens_per_s")) * stages.get("rollout", 0.0),
                   train_tokens=_number(row.get("throughput/step_tokens_per_s")) * step_seconds,
                   rollout_wait_seconds=_number(row.get("time/wait_trainer")), concurrent=concurrent)


@dataclass
class StageProfile:
    """Cumulative stage profile of a run, fed one :class:`StepTimes` at a time.

    Invariant: ``stage_seconds``, ``wall_seconds`` and the token counts are sums over the
    observed steps, so :meth:`summary` is a pure function of the rows observed.
    """

    factors: tuple[float, ...] = DEFAULT_FACTORS
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_seconds: float = 0.0
    steps: int = 0
    rollout_tokens: float = 0.0
    train_tokens: float = 0.0
    rollout_wait_seconds: float = 0.0
    concurrent: bool = False

    def observe(self, times: StepTimes) -> dict[str, float]:
        """Add one step; returns its ``throughput/train_tokens_per_s``."""
        for stage, seconds in times.stage_seconds.items():
            self.stage_seconds[stage] += seconds
        self.wall_seconds += times.wall_seconds
        self.steps += 1
        self.rollout_tokens += times.rollout_tokens
        self.train_tokens += times.train_tokens
        self.rollout_wait_seconds += times.rollout_wait_seconds
        self.concurrent = self.concurrent or times.concurrent
        return {"throughput/train_tokens_per_s": _rate(times.train_tokens, _train_seconds(times.stage_seconds))}

    def observe_row(self, row: Mapping) -> dict[str, float]:
        """:meth:`observe` of ``StepTimes.from_row(row)``; {} for a row without stage times."""
        times = StepTimes.from_row(row)
        return self.observe(times) if times is not None else {}

    def summary(self) -> dict:
        """A JSON-ready dict for ``summary.json["profile"]``; every figure the console and the
        report show about time comes from here."""
        wall = self.wall_seconds
        out = {
            "mode": "async" if self.concurrent else "sync",
            "steps": self.steps,
            "wall_seconds": wall,
            "step_seconds_mean": wall / self.steps if self.steps else 0.0,
            "stage_seconds": dict(self.stage_seconds),
            "stage_share": {s: t / wall if wall > 0 else 0.0 for s, t in self.stage_seconds.items()},
            "amdahl": amdahl_table(self.stage_seconds, self.factors, self.concurrent),
            "tokens_per_s": {"rollout": _rate(self.rollout_tokens, self.stage_seconds.get("rollout", 0.0)),
                             "train": _rate(self.train_tokens, _train_seconds(self.stage_seconds))},
        }
        if self.concurrent:
            rollout = sum(self.stage_seconds.get(s, 0.0) for s in ROLLOUT_LANE)
            trainer = sum(t for s, t in work_seconds(self.stage_seconds).items() if s not in ROLLOUT_LANE)
            out["async"] = {"overlap": lane_overlap(rollout, trainer, wall), "rollout_lane_seconds": rollout,
                            "trainer_lane_seconds": trainer, "rollout_wait_seconds": self.rollout_wait_seconds}
        return out


def profile_from_rows(rows: Iterable[Mapping]) -> StageProfile:
    """The profile of a run rebuilt from its metrics.jsonl rows (rows without times skipped)."""
    profile = StageProfile()
    for row in rows:
        profile.observe_row(row)
    return profile


# ----------------------------------------------------------------------------- presenting


def headline(summary: Mapping, factor: float = 5.0) -> str:
    """One sentence naming the bottleneck, from ``StageProfile.summary()``, e.g. ``rollout is
    64% of the step: 5x faster rollout -> step 2.05x faster (at most 2.78x)``."""
    amdahl, seconds = summary.get("amdahl") or {}, summary.get("stage_seconds") or {}
    if not amdahl:
        return "no stage time recorded"
    # the bottleneck: the stage whose removal would help most (in async, a stage of the longer lane)
    stage = max(amdahl, key=lambda s: (round(amdahl[s]["inf"], 6), seconds[s]))
    concurrent = summary.get("mode") == "async"
    share = 100 * summary["stage_share"][stage]
    fast = amdahl_speedup(seconds, stage, factor, concurrent)
    limit = amdahl_speedup(seconds, stage, float("inf"), concurrent)
    what = "the wall time (async: the rollout and trainer lanes run concurrently)" if concurrent else "the step"
    return (f"{stage} is {share:.0f}% of {what}: {factor:g}x faster {stage} -> step "
            f"{fast:.2f}x faster (at most {limit:.2f}x)")


def throughput_line(summary: Mapping) -> str:
    """Tokens/s, step time and (async) overlap, as the console and the report print them."""
    tps = summary["tokens_per_s"]
    line = (f"rollout {tps['rollout']:,.0f} tokens/s, training {tps['train']:,.0f} tokens/s, "
            f"{summary['step_seconds_mean']:.3f} s per step over {summary['steps']} steps")
    if "async" in summary:
        a = summary["async"]
        line += (f"; async overlap {100 * a['overlap']:.0f}% (of the shorter lane's "
                 f"{min(a['rollout_lane_seconds'], a['trainer_lane_seconds']):.1f} s, hidden behind the other)")
    return line


def profile_rows(summary: Mapping) -> list[list[str]]:
    """One row per stage, longest first: stage, total s, share, s/step, then the Amdahl
    speed-ups (``-`` for wait stages), formatted as both the console and the report show them."""
    labels = [factor_label(k) for k in DEFAULT_FACTORS]
    steps = max(summary.get("steps", 0), 1)
    rows = []
    for stage, seconds in sorted(summary["stage_seconds"].items(), key=lambda kv: -kv[1]):
        amdahl = summary["amdahl"].get(stage)
        speedups = [f"{amdahl[label]:.2f}x" if amdahl else "-" for label in labels]
        rows.append([stage, f"{seconds:.2f}", f"{100 * summary['stage_share'][stage]:.1f}%",
                     f"{seconds / steps:.3f}", *speedups])
    return rows


PROFILE_HEADER = ("stage", "total s", "share of wall", "s/step", "step speed-up if 2x faster",
                  "if 5x faster", "if free")
#: The console's narrower header (an 80-column terminal must show every number).
CONSOLE_HEADER = ("stage", "total s", "share", "s/step", "2x", "5x", "free")


def profile_table(summary: Mapping, title: str = "stage profile") -> Table:
    """A rich table of :func:`profile_rows` with :func:`throughput_line` as its caption."""
    table = Table(title=f"{title}: step speed-up if the stage gets 2x, 5x faster or free", show_header=True)
    for name in CONSOLE_HEADER:
        table.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    for row in profile_rows(summary):
        table.add_row(*row)
    table.caption = throughput_line(summary)
    return table


def _train_seconds(stage_seconds: Mapping[str, float]) -> float:
    return sum(stage_seconds.get(s, 0.0) for s in TRAIN_STAGES)


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value) -> float:
    return float(value) if _is_number(value) else 0.0
