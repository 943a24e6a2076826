"""The report's plots: one function per figure, metrics.jsonl rows in, PNG bytes out.

Each function returns ``None`` when the run has no data for it (e.g. no KL without a
reference model), and the report says "not applicable" instead of drawing an empty axis.
Figures are built with matplotlib's object API on the Agg canvas (no pyplot global state,
no display needed).
"""
from __future__ import annotations

import io
import math
from collections import Counter
from typing import Mapping, Optional, Sequence

Rows = Sequence[Mapping]

#: Stage colours, fixed so every report reads the same way.
STAGE_COLORS = {"rollout": "#4C72B0", "reward": "#DD8452", "old_logprobs": "#55A868",
                "ref_logprobs": "#C44E52", "actor_update": "#8172B3", "critic_update": "#937860",
                "weight_sync": "#DA8BC3", "between_steps": "#8C8C8C", "wait_rollout": "#CCCCCC"}


def available() -> bool:
    """True when matplotlib can be imported (it is the optional extra ``asyncrl[report]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows that have it; "nan"/"inf" strings parse."""
    steps, values = [], []
    for row in rows:
        if key in row and "step" in row:
            try:
                value = float(row[key])
            except (TypeError, ValueError):
                continue
            steps.append(int(row["step"]))
            values.append(value)
    return steps, values


def has(rows: Rows, key: str) -> bool:
    return any(key in row for row in rows)


def _figure(title: str, ylabel: str, xlabel: str = "step"):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False)  # "+3.96" offsets hide the real values
    return fig, ax


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _lines(rows: Rows, keys: Sequence[str], title: str, ylabel: str, markers: Sequence[str] = ()) -> Optional[bytes]:
    """A line per key present in the rows; keys in ``markers`` are drawn as points (sparse)."""
    present = [k for k in keys if has(rows, k)]
    if not present:
        return None
    fig, ax = _figure(title, ylabel)
    for key in present:
        steps, values = series(rows, key)
        style = dict(marker="o", linestyle="--") if key in markers else {}
        ax.plot(steps, values, label=key, **style)
    ax.legend(fontsize=8)
    return _png(fig)


def smooth(values: Sequence[float], window: Optional[int] = None) -> list[float]:
    """Trailing mean over ``window`` points (default: 1/30 of the series, at least 1), the
    curve drawn over the raw values: an RL reward is a noisy per-batch mean."""
    window = window or max(1, round(len(values) / 30))
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _smoothed(ax, steps, values, label: str, color: Optional[str] = None) -> None:
    """The raw series faint behind its smoothed curve (one legend entry, for the smooth one)."""
    raw = ax.plot(steps, values, alpha=0.25, linewidth=0.8, color=color)[0]
    window = max(1, round(len(values) / 30))
    ax.plot(steps, smooth(values, window), color=raw.get_color(), linewidth=1.8,
            label=f"{label} (mean of {window} steps)" if window > 1 else label)


def _same_series(rows: Rows, a: str, b: str) -> bool:
    """True when ``a`` and ``b`` hold the same values at every step (a 0/1 reward: mean = accuracy)."""
    sa, sb = series(rows, a), series(rows, b)
    return sa[0] == sb[0] and all(abs(x - y) < 1e-12 for x, y in zip(sa[1], sb[1]))


def reward(rows: Rows) -> Optional[bytes]:
    """Train reward per step, smoothed with the raw values behind; ``reward/accuracy`` too when it
    differs from ``reward/mean`` (with a 0/1 reward they are the same curve)."""
    if not has(rows, "reward/mean"):
        return None
    fig, ax = _figure("train reward (this step's rollouts)", "reward")
    _smoothed(ax, *series(rows, "reward/mean"), "reward/mean")
    if has(rows, "reward/accuracy") and not _same_series(rows, "reward/mean", "reward/accuracy"):
        _smoothed(ax, *series(rows, "reward/accuracy"), "reward/accuracy")
    ax.legend(fontsize=8)
    return _png(fig)


#: (metrics.jsonl key, summary.json key before RL, after RL, label) of the held-out accuracies.
HELDOUT = (("eval/accuracy", "sft_accuracy", "final_accuracy", "greedy"),
           ("eval/sampled_accuracy", "sft_sampled_accuracy", "final_sampled_accuracy", "sampled (mean@k)"))


def heldout_accuracy(rows: Rows, summary: Mapping) -> Optional[bytes]:
    """Held-out accuracy, greedy and sampled: before RL (step 0), every mid-run eval, after RL."""
    last = max((int(r["step"]) for r in rows if "step" in r), default=summary.get("steps") or 0)
    curves = []
    for key, before_key, after_key, label in HELDOUT:
        steps, values = series(rows, key)
        if summary.get(before_key) is not None:
            steps, values = [0] + steps, [float(summary[before_key])] + values
        if summary.get(after_key) is not None and (not steps or steps[-1] != last):
            steps, values = steps + [last], values + [float(summary[after_key])]
        if steps:
            curves.append((steps, values, label))
    if not curves:
        return None
    fig, ax = _figure("held-out accuracy (step 0: before RL)", "accuracy")
    for steps, values, label in curves:
        ax.plot(steps, values, marker="o", label=label)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return _png(fig)


def sft_loss(rows: Rows) -> Optional[bytes]:
    """``asyncrl sft``: the NLL of the response tokens per step, smoothed over the raw values."""
    if not has(rows, "sft/loss"):
        return None
    fig, ax = _figure("SFT loss", "nats / token")
    _smoothed(ax, *series(rows, "sft/loss"), "sft/loss")
    ax.legend(fontsize=8)
    return _png(fig)


def kl(rows: Rows) -> Optional[bytes]:
    return _lines(rows, ("kl/ref", "actor/kl_loss", "actor/ppo_kl"), "KL", "nats / token")


def entropy(rows: Rows) -> Optional[bytes]:
    return _lines(rows, ("actor/entropy",), "policy entropy", "nats / token")


def response_length(rows: Rows) -> Optional[bytes]:
    return _lines(rows, ("response/length_mean", "response/length_max"), "response length", "tokens")


def throughput(rows: Rows) -> Optional[bytes]:
    return _lines(rows, ("throughput/rollout_tokens_per_s", "throughput/step_tokens_per_s",
                         "throughput/train_tokens_per_s"), "throughput", "tokens / s")


def stage_times(rows: Rows) -> Optional[bytes]:
    """Stacked area of each step's stage seconds, as the profile reads them (async: the
    rollout lane's time is its own layer; the trainer lane's layers add up to the wall time)."""
    from asyncrl.metrics.profile import StepTimes

    timed = [(int(row["step"]), t) for row in rows if "step" in row for t in [StepTimes.from_row(row)] if t]
    stages = sorted({s for _, t in timed for s in t.stage_seconds},
                    key=lambda s: list(STAGE_COLORS).index(s) if s in STAGE_COLORS else len(STAGE_COLORS))
    if not timed:
        return None
    steps = [step for step, _ in timed]
    layers = [[t.stage_seconds.get(s, 0.0) for _, t in timed] for s in stages]
    fig, ax = _figure("stage time per step (stacked)", "seconds")
    ax.stackplot(steps, layers, labels=stages, colors=[STAGE_COLORS.get(s, "#999999") for s in stages], alpha=0.85)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    return _png(fig)


def staleness_counts(rows: Rows) -> Optional[Counter]:
    """Samples by staleness (versions between the policy that generated a sample and the one
    trained on it), summed over the run from the per-step ``async/staleness_hist/<k>``."""
    counts: Counter = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("async/staleness_hist/"):
                counts[int(key.rsplit("/", 1)[1])] += _number(value)
    return counts or None


def staleness(rows: Rows) -> Optional[bytes]:
    """Histogram of per-sample staleness, and the per-step mean beside it (async runs)."""
    counts = staleness_counts(rows)
    if not counts and not has(rows, "async/staleness_mean"):
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.2), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2)
    if counts:
        keys = sorted(counts)
        left.bar(keys, [counts[k] for k in keys], color="#4C72B0")
        left.set_xticks(keys)
    left.set_title("samples by staleness", fontsize=10)
    left.set_xlabel("versions behind the trainer")
    left.set_ylabel("samples")
    for key in ("async/staleness_mean", "async/staleness_max", "async/version_lag"):
        if has(rows, key):
            right.plot(*series(rows, key), label=key, linewidth=1)
    right.set_title("per step", fontsize=10)
    right.set_xlabel("step")
    right.legend(fontsize=7)
    return _png(fig)


def health_timeline(events: Sequence) -> Optional[bytes]:
    """One row of marks per health monitor at the steps it fired (from its HealthEvents)."""
    fired: dict[str, list[int]] = {}
    for event in events:
        fired.setdefault(event.monitor, []).append(event.step)
    if not fired:
        return None
    fig, ax = _figure("health warnings", "")
    names = sorted(fired)
    for i, name in enumerate(names):
        ax.scatter(fired[name], [i] * len(fired[name]), marker="|", s=200, color="#C44E52")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.5, len(names) - 0.5)
    return _png(fig)


def _number(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def overlay(runs: Sequence[tuple[str, Rows]], key: str, title: str, ylabel: str,
            smoothed: bool = True) -> Optional[bytes]:
    """``key`` of several runs on one axis (``asyncrl report RUN_A RUN_B``), each run's curve
    smoothed over its raw values, or as points joined by lines for sparse keys (evals)."""
    present = [(name, rows) for name, rows in runs if has(rows, key)]
    if not present:
        return None
    fig, ax = _figure(title, ylabel)
    for name, rows in present:
        steps, values = series(rows, key)
        if smoothed:
            _smoothed(ax, steps, values, name)
        else:
            ax.plot(steps, values, marker="o", label=name)
    ax.legend(fontsize=8)
    return _png(fig)
