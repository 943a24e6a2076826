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
                "weight_sync": "#DA8BC3", "rollout_wait": "#BBBBBB", "trainer_wait": "#888888"}


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


def reward_accuracy(rows: Rows, summary: Mapping) -> Optional[bytes]:
    """Train reward and accuracy per step, held-out accuracy at each eval, before and after RL."""
    if not (has(rows, "reward/mean") or has(rows, "eval/accuracy")):
        return None
    fig, ax = _figure("reward and accuracy", "value")
    for key in ("reward/mean", "reward/accuracy"):
        if has(rows, key):
            ax.plot(*series(rows, key), label=key, alpha=0.8)
    if has(rows, "eval/accuracy"):
        ax.plot(*series(rows, "eval/accuracy"), marker="o", linestyle="--", label="eval/accuracy (held-out)")
    steps = [int(r["step"]) for r in rows if "step" in r]
    if summary.get("sft_accuracy") is not None and steps:
        ax.scatter([0], [summary["sft_accuracy"]], marker="s", color="black", zorder=3, label="held-out before RL")
    if summary.get("final_accuracy") is not None and steps:
        ax.scatter([max(steps)], [summary["final_accuracy"]], marker="*", s=120, color="black", zorder=3,
                   label="held-out after RL")
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
    """Stacked area of ``time/<stage>`` per step: the step's time, split by stage."""
    stages = sorted({k[5:] for row in rows for k in row if k.startswith("time/") and k not in ("time/step", "time/wall")},
                    key=lambda s: list(STAGE_COLORS).index(s) if s in STAGE_COLORS else len(STAGE_COLORS))
    timed = [row for row in rows if any(f"time/{s}" in row for s in stages)]
    if not stages or not timed:
        return None
    steps = [int(row["step"]) for row in timed]
    layers = [[_number(row.get(f"time/{s}")) for row in timed] for s in stages]
    fig, ax = _figure("stage time per step (stacked)", "seconds")
    ax.stackplot(steps, layers, labels=stages, colors=[STAGE_COLORS.get(s, "#999999") for s in stages], alpha=0.85)
    ax.legend(fontsize=8, loc="upper left", ncols=3)
    return _png(fig)


def staleness_counts(rows: Rows) -> tuple[Optional[Counter], str]:
    """Histogram data and what it counts.

    Preferred: per-sample staleness counts the async runtime logs as
    ``async/staleness_hist/<versions>`` (samples per step trained that many versions after the
    policy that generated them), summed over the run. Else: the per-step ``async/version_lag``.
    """
    counts: Counter = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("async/staleness_hist/"):
                counts[int(key.rsplit("/", 1)[1])] += _number(value)
    if counts:
        return counts, "samples"
    _, lags = series(rows, "async/version_lag")
    if lags:
        return Counter(int(round(v)) for v in lags if math.isfinite(v)), "steps (async/version_lag)"
    return None, ""


def staleness(rows: Rows) -> Optional[bytes]:
    counts, what = staleness_counts(rows)
    if not counts:
        return None
    fig, ax = _figure("staleness", what, xlabel="policy versions behind")
    keys = sorted(counts)
    ax.bar(keys, [counts[k] for k in keys], color="#4C72B0")
    ax.set_xticks(keys)
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
