"""``asyncrl report RUN_DIR``: one self-contained HTML page about a run.

Reads what a run directory holds (``metrics.jsonl``, ``summary.json``,
``health_events.jsonl``, ``config.yaml``) and writes ``RUN_DIR/report.html``: the summary,
the stage profile with its Amdahl projection, the health events, and matplotlib plots
embedded as base64 PNG, so the page is a single file that opens anywhere, offline.
Works on a finished run and on one still in progress (whatever rows exist so far).
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from asyncrl.metrics import report_plots as plots
from asyncrl.metrics.health import HealthEvent, read_events, replay
from asyncrl.metrics.profile import ASYNC_LANES, StageProfile, factor_label, headline, profile_from_rows

REPORT_NAME = "report.html"


@dataclass
class RunData:
    """Everything the report reads from a run directory."""

    run_dir: Path
    rows: list[dict]
    summary: dict = field(default_factory=dict)
    events: list[HealthEvent] = field(default_factory=list)
    config_text: str = ""
    events_replayed: bool = False  # no health_events.jsonl: events recomputed from metrics.jsonl


def load_run(run_dir: Path) -> RunData:
    """Read a run directory; only ``metrics.jsonl`` is required."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} an asyncrl run directory?")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.yaml"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config_text = config_path.read_text() if config_path.is_file() else ""
    events_path = run_dir / "health_events.jsonl"
    if events_path.is_file():
        return RunData(run_dir, rows, summary, read_events(events_path), config_text)
    # A run logged without the monitor: replay the metrics through it with default thresholds.
    return RunData(run_dir, rows, summary, replay(rows).events, config_text, events_replayed=True)


def write_report(run_dir: Path, output: Optional[Path] = None) -> Path:
    """Render the report of ``run_dir``; returns its path (default ``RUN_DIR/report.html``)."""
    run = load_run(run_dir)
    output = Path(output) if output else run.run_dir / REPORT_NAME
    output.write_text(render(run))
    return output


NO_MATPLOTLIB = "plot not drawn: matplotlib is not installed (pip install 'asyncrl[report]')"


def render(run: RunData) -> str:
    """The whole HTML page. Without matplotlib the tables are still written, the plots not."""
    async_run = any("async/version_lag" in r or "time/wall" in r for r in run.rows)
    profile = profile_from_rows(run.rows, lanes=ASYNC_LANES if async_run else None)
    draw = plots.available()

    def figure(plot, alt, missing="no data for this plot in metrics.jsonl"):
        return _image(plot() if draw else None, alt, missing if draw else NO_MATPLOTLIB)

    rows = run.rows
    sections = [
        _section("Summary", _summary_table(run)),
        _section("Stage profile", _profile_html(profile)),
        _section("Health", _health_html(run.events, run.events_replayed)),
        _section("Reward and accuracy", figure(lambda: plots.reward_accuracy(rows, run.summary), "reward and accuracy")),
        _section("KL", figure(lambda: plots.kl(rows), "KL",
                              "no KL metrics: the run has no reference model (algorithm.kl_coef = 0)")),
        _section("Entropy", figure(lambda: plots.entropy(rows), "entropy")),
        _section("Response length", figure(lambda: plots.response_length(rows), "response length")),
        _section("Stage time", figure(lambda: plots.stage_times(rows), "stage time stacked area")),
        _section("Throughput", figure(lambda: plots.throughput(rows), "throughput")),
        _section("Staleness", figure(lambda: plots.staleness(rows), "staleness histogram",
                                     "not applicable: synchronous run, every sample is trained on-policy "
                                     "(no async/staleness_hist/* or async/version_lag metrics)")),
        _section("Health timeline", figure(lambda: plots.health_timeline(run.events), "health timeline",
                                           "no health warning fired")),
        _section("Memory", _memory_html(run)),
    ]
    if run.config_text:
        sections.append(_section("Config", f"<details><summary>config.yaml</summary><pre>"
                                           f"{html.escape(run.config_text)}</pre></details>"))
    title = f"asyncrl report: {run.summary.get('name') or run.run_dir.name}"
    return _PAGE.format(title=html.escape(title), run_dir=html.escape(str(run.run_dir)),
                        steps=len(run.rows), body="\n".join(sections))


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{body}\n</section>"


def _image(png: Optional[bytes], alt: str, missing: str = "no data for this plot in metrics.jsonl") -> str:
    if png is None:
        return f'<p class="na">{html.escape(missing)}</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary_table(run: RunData) -> str:
    keys = ("name", "seed", "steps", "sft_accuracy", "final_accuracy", "accuracy_gain", "rl_seconds",
            "wall_seconds", "checkpoint")
    rows = [(k, run.summary[k]) for k in keys if run.summary.get(k) is not None]
    rows += _efficiency_rows(run.rows)
    if not run.summary:
        rows.insert(0, ("summary.json", "absent (run in progress or interrupted)"))
    return _table(("metric", "value"), rows)


def _efficiency_rows(rows: list[dict]) -> list[tuple[str, float]]:
    """Sample efficiency: train reward gain per 1k samples, from first to last 5-step window."""
    _, rewards = plots.series(rows, "reward/mean")
    _, samples_per_s = plots.series(rows, "throughput/samples_per_s")
    _, step_s = plots.series(rows, "time/step")
    if len(rewards) < 2 or len(samples_per_s) != len(step_s) or not samples_per_s:
        return []
    samples = sum(a * b for a, b in zip(samples_per_s, step_s))
    window = max(1, min(5, len(rewards) // 2))
    gain = sum(rewards[-window:]) / window - sum(rewards[:window]) / window
    return [("samples trained", round(samples)),
            ("reward gain per 1k samples", 1000 * gain / samples if samples else 0.0)]


def _profile_html(profile: StageProfile) -> str:
    if not profile.steps:
        return '<p class="na">no time/&lt;stage&gt; metrics in metrics.jsonl</p>'
    summary = profile.summary()
    labels = [factor_label(k) for k in profile.factors]
    header = ["stage", "total s", "share", "per step s"] + [
        f"step speed-up if {l} faster" if l != "inf" else "step speed-up if free" for l in labels]
    rows = []
    for stage, seconds in sorted(summary["stage_seconds"].items(), key=lambda kv: -kv[1]):
        speedups = [f"{summary['amdahl'][stage][l]:.2f}x" if stage in summary["amdahl"] else "-" for l in labels]
        rows.append([stage, seconds, f"{100 * summary['stage_share'][stage]:.1f}%",
                     seconds / profile.steps, *speedups])
    tps = summary["tokens_per_s"]
    notes = [headline(profile), f"rollout {tps['rollout']:.0f} tokens/s, training {tps['train']:.0f} tokens/s, "
                                f"{summary['step_seconds_mean']:.3f} s per step over {profile.steps} steps"]
    if "async" in summary:
        notes.append(f"async overlap {100 * summary['async']['overlap']:.0f}% of the work "
                     f"({100 * summary['async']['overlap_efficiency']:.0f}% of what perfect overlap would hide)")
    return "".join(f"<p>{html.escape(n)}</p>" for n in notes) + _table(header, rows)


def _health_html(events: list[HealthEvent], replayed: bool = False) -> str:
    """Events grouped into episodes: consecutive firing steps of one monitor are one row."""
    note = ('<p class="na">no health_events.jsonl: monitors replayed over metrics.jsonl with default '
            'thresholds (length_hacking needs per-sample data and is not replayed)</p>' if replayed else "")
    if not events:
        return note + '<p class="ok">no health warning fired</p>'
    episodes: list[dict] = []
    for event in sorted(events, key=lambda e: (e.monitor, e.step)):
        last = episodes[-1] if episodes else None
        if last and last["monitor"] == event.monitor and event.step - last["last"] <= 1:
            last.update(last=event.step, count=last["count"] + 1, value=event.value)
        else:
            episodes.append({"monitor": event.monitor, "first": event.step, "last": event.step, "count": 1,
                             "value": event.value, "threshold": event.threshold, "message": event.message})
    episodes.sort(key=lambda e: e["first"])
    rows = [(e["monitor"], e["first"], e["last"], e["count"], e["value"], e["threshold"], e["message"])
            for e in episodes]
    return note + _table(("monitor", "first step", "last step", "steps", "last value", "threshold", "message"), rows)


def _memory_html(run: RunData) -> str:
    memory = run.summary.get("memory", {}).get("peak_mib")
    if not memory:
        peaks: dict[str, float] = {}
        for row in run.rows:
            for key, value in row.items():
                if key.startswith("memory/") and key.endswith("_peak_mib") and key != "memory/peak_mib":
                    stage = key[len("memory/"):-len("_peak_mib")]
                    peaks[stage] = max(peaks.get(stage, 0.0), float(value))
        memory = peaks
    if not memory:
        return '<p class="na">no memory/* metrics logged</p>'
    kind = run.summary.get("memory", {}).get("kind", "")
    caption = f"<p>peak {html.escape(kind or 'memory')} per stage, MiB</p>"
    return caption + _table(("stage", "peak MiB"), sorted(memory.items(), key=lambda kv: -kv[1]))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 980px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
img {{ max-width: 100%; }}
.na {{ color: #777; font-style: italic; }}
.ok {{ color: #2a7a2a; }}
</style></head>
<body>
<h1>{title}</h1>
<p>run directory: <code>{run_dir}</code> · {steps} logged steps</p>
{body}
</body></html>
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry: ``asyncrl report RUN_DIR [-o OUTPUT]``; prints the report's path."""
    parser = argparse.ArgumentParser(prog="asyncrl report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<time>-<name>)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="HTML path (default RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.output)
    except FileNotFoundError as err:
        print(f"asyncrl report: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
