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
from asyncrl.metrics.console import accuracy_rows
from asyncrl.metrics.health import HealthEvent, group_events, read_events, replay
from asyncrl.metrics.profile import PROFILE_HEADER, headline, profile_from_rows, profile_rows, throughput_line
from asyncrl.metrics.sinks import SAMPLES_FILE

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
    samples: list[dict] = field(default_factory=list)  # samples.jsonl: completions per held-out eval


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
    samples_path = run_dir / SAMPLES_FILE
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()
               if line.strip()] if samples_path.is_file() else []
    events_path = run_dir / "health_events.jsonl"
    if events_path.is_file():
        return RunData(run_dir, rows, summary, read_events(events_path), config_text, samples=samples)
    # A run logged without the monitor: replay the metrics through it with default thresholds.
    return RunData(run_dir, rows, summary, replay(rows).events, config_text, events_replayed=True, samples=samples)


def write_report(run_dir: Path, output: Optional[Path] = None) -> Path:
    """Render the report of ``run_dir``; returns its path (default ``RUN_DIR/report.html``)."""
    run = load_run(run_dir)
    output = Path(output) if output else run.run_dir / REPORT_NAME
    output.write_text(render(run))
    return output


NO_MATPLOTLIB = "plot not drawn: matplotlib is not installed (pip install 'asyncrl[report]')"


def run_profile(run: RunData) -> dict:
    """The run's profile summary: summary.json's (what the console printed), else rebuilt from
    metrics.jsonl by the same code (a run in progress), so both show the same figures."""
    return run.summary.get("profile") or profile_from_rows(run.rows).summary()


def render(run: RunData) -> str:
    """The whole HTML page: what a user looks for first (held-out accuracy before/after, the
    reward curve), then the stage profile, the health table, sampled completions, the rest.
    Without matplotlib the tables are still written, the plots not (the page says so)."""
    draw = plots.available()

    def figure(plot, alt, missing="no data for this plot in metrics.jsonl"):
        return _image(plot() if draw else None, alt, missing if draw else NO_MATPLOTLIB)

    rows, profile = run.rows, run_profile(run)
    sections = [
        _section("Held-out accuracy and reward", _accuracy_html(run.summary)
                 + figure(lambda: plots.heldout_accuracy(rows, run.summary), "held-out accuracy",
                          "no held-out evaluation in this run")
                 + figure(lambda: plots.reward(rows), "train reward")),
        *([_section("SFT loss", figure(lambda: plots.sft_loss(rows), "SFT loss"))] if plots.has(rows, "sft/loss") else []),
        _section("Stage profile", _profile_html(profile)),
        _section("Health", _health_html(run.events, run.events_replayed)),
        _section("Sampled completions", _samples_html(run.samples)),
        _section("KL", figure(lambda: plots.kl(rows), "KL",
                              "no KL metrics: the run has no reference model (algorithm.kl_coef = 0)")),
        _section("Entropy", figure(lambda: plots.entropy(rows), "entropy")),
        _section("Response length", figure(lambda: plots.response_length(rows), "response length")),
        _section("Stage time", figure(lambda: plots.stage_times(rows), "stage time stacked area")),
        _section("Throughput", figure(lambda: plots.throughput(rows), "throughput")),
        _section("Staleness", figure(lambda: plots.staleness(rows), "staleness",
                                     "not applicable: synchronous run, every sample is trained on-policy")),
        _section("Health timeline", figure(lambda: plots.health_timeline(run.events), "health timeline",
                                           "no health warning fired")),
        _section("Memory", _memory_html(run)),
        _section("Run", _summary_table(run)),
    ]
    if run.config_text:
        sections.append(_section("Config", f"<details><summary>config.yaml</summary><pre>"
                                           f"{html.escape(run.config_text)}</pre></details>"))
    title = f"asyncrl report: {run.summary.get('name') or run.run_dir.name}"
    return _PAGE.format(title=html.escape(title), run_dir=html.escape(str(run.run_dir)),
                        steps=len(run.rows), mode=profile.get("mode", "sync"), body="\n".join(sections))


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{body}\n</section>"


def _image(png: Optional[bytes], alt: str, missing: str = "no data for this plot in metrics.jsonl") -> str:
    if png is None:
        return f'<p class="na">{html.escape(missing)}</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: Sequence[str], rows: Sequence[Sequence], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _accuracy_html(summary: dict) -> str:
    rows = accuracy_rows(summary)
    if not rows:
        note = "absent (run in progress or interrupted)" if not summary else "no held-out set"
        return f'<p class="na">held-out accuracy before/after RL: {note}</p>'
    return _table(("held-out accuracy", "before RL -> after RL"), rows, cls="headline")


def _summary_table(run: RunData) -> str:
    keys = ("name", "seed", "steps", "rl_seconds", "wall_seconds", "source", "model_path", "checkpoint")
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


def _profile_html(profile: dict) -> str:
    if not profile.get("steps"):
        return '<p class="na">no time/&lt;stage&gt; metrics in metrics.jsonl</p>'
    notes = [headline(profile), throughput_line(profile)]
    if profile.get("mode") == "async":
        notes.append("async: the rollout lane (generation) and the trainer lane (its stages, between_steps and "
                     "wait_rollout) run at the same time, so each adds up to about 100% of the wall time; "
                     f"rollout workers waited {profile['async']['rollout_wait_seconds']:.1f} s on the staleness "
                     "bound (time/wait_trainer, summed over workers)")
    return "".join(f"<p>{html.escape(n)}</p>" for n in notes) + _table(PROFILE_HEADER, profile_rows(profile))


def _health_html(events: list[HealthEvent], replayed: bool = False) -> str:
    """One row per monitor that fired: first and last step, steps fired, episodes, worst value."""
    note = ('<p class="na">no health_events.jsonl: monitors replayed over metrics.jsonl with default '
            'thresholds (length_hacking needs per-sample data and is not replayed)</p>' if replayed else "")
    if not events:
        return note + '<p class="ok">no health warning fired</p>'
    rows = [(g["monitor"], g["first"], g["last"], g["steps"], g["episodes"], g["worst"], g["threshold"], g["message"])
            for g in group_events(events)]
    return note + _table(("monitor", "first step", "last step", "steps fired", "episodes", "worst value",
                          "threshold", "first message"), rows)


def _samples_html(samples: list[dict]) -> str:
    """A few completions per held-out eval (step 0: before RL), the last eval open."""
    if not samples:
        return '<p class="na">no samples.jsonl (runs before this version, or no held-out set)</p>'
    by_step: dict[int, list[dict]] = {}
    for sample in samples:
        by_step.setdefault(int(sample["step"]), []).append(sample)
    parts = []
    for i, (step, items) in enumerate(sorted(by_step.items())):
        rows = [(s.get("tag", "").removeprefix("samples/"), s["prompt"], s["response"], s["reward"]) for s in items]
        is_open = " open" if i == len(by_step) - 1 else ""
        label = "before RL" if step == 0 else f"step {step}"
        parts.append(f"<details{is_open}><summary>{label}</summary>"
                     f"{_table(('kind', 'prompt', 'response', 'reward'), rows, cls='samples')}</details>")
    return "".join(parts)


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
table.headline td {{ font-size: 1.15em; }}
table.samples td {{ font-family: ui-monospace, monospace; white-space: pre-wrap; max-width: 40em; }}
</style></head>
<body>
<h1>{title}</h1>
<p>run directory: <code>{run_dir}</code> · {steps} logged steps · {mode} runtime</p>
{body}
</body></html>
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry: ``asyncrl report RUN_DIR [RUN_DIR ...] [-o OUTPUT]``; prints the page's path.
    One run: its report. Several: one page overlaying them (report_compare.py)."""
    parser = argparse.ArgumentParser(prog="asyncrl report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                        help="a run directory (runs/<time>-<job>-<name>); two or more: overlay them on one page")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="HTML path (default RUN_DIR/report.html; several runs: compare.html in the first)")
    args = parser.parse_args(argv)
    try:
        if len(args.run_dirs) == 1:
            path = write_report(args.run_dirs[0], args.output)
        else:
            from asyncrl.metrics.report_compare import write_comparison
            path = write_comparison(args.run_dirs, args.output)
    except FileNotFoundError as err:
        print(f"asyncrl report: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
