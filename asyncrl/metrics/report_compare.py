"""``asyncrl report RUN_A RUN_B ...``: several runs overlaid on one self-contained page.

One row per run for the figures a comparison is about (held-out accuracy before/after, greedy
and sampled; time per step; tokens/s; the bottleneck), then the curves of every run on shared
axes: the smoothed train reward, the held-out accuracy at each eval, throughput and step time.
Every number is read the way the single-run report reads it (``report.run_profile``).
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional, Sequence

from asyncrl.metrics import report_plots as plots
from asyncrl.metrics.profile import headline
from asyncrl.metrics.report import _PAGE, RunData, _image, _section, _table, load_run, run_profile

COMPARE_NAME = "compare.html"
#: (metrics.jsonl key, title, y label, smoothed) of the overlaid curves.
OVERLAYS = (("reward/mean", "train reward", "reward", True),
            ("eval/accuracy", "held-out accuracy, greedy (mid-run evals)", "accuracy", False),
            ("eval/sampled_accuracy", "held-out accuracy, sampled (mid-run evals)", "accuracy", False),
            ("throughput/rollout_tokens_per_s", "rollout tokens/s", "tokens / s", True),
            ("time/step", "trainer step time", "seconds", True))


def run_label(run: RunData) -> str:
    """A run's name on the page: its directory name (unique, carries time, job and recipe)."""
    return run.run_dir.name


def comparison_rows(runs: Sequence[RunData]) -> list[list]:
    """One row per run: label, mode, steps, greedy and sampled accuracy before -> after,
    seconds per step, rollout and train tokens/s, the profile's headline."""
    out = []
    for run in runs:
        s, profile = run.summary, run_profile(run)
        tps = profile.get("tokens_per_s", {})
        out.append([run_label(run), profile.get("mode", "sync"), s.get("steps", len(run.rows)),
                    _arrow(s.get("sft_accuracy"), s.get("final_accuracy")),
                    _arrow(s.get("sft_sampled_accuracy"), s.get("final_sampled_accuracy")),
                    f"{profile.get('step_seconds_mean', 0.0):.3f}", f"{tps.get('rollout', 0.0):,.0f}",
                    f"{tps.get('train', 0.0):,.0f}", headline(profile) if profile.get("steps") else "-"])
    return out


def render_comparison(runs: Sequence[RunData]) -> str:
    draw = plots.available()
    labelled = [(run_label(r), r.rows) for r in runs]
    header = ("run", "mode", "steps", "greedy before -> after", "sampled before -> after", "s/step",
              "rollout tok/s", "train tok/s", "bottleneck")
    sections = [_section("Runs", _table(header, comparison_rows(runs)))]
    for key, title, ylabel, smoothed in OVERLAYS:
        png = plots.overlay(labelled, key, title, ylabel, smoothed) if draw else None
        sections.append(_section(title, _image(png, title, f"no {key} in these runs" if draw else
                                               "plot not drawn: matplotlib is not installed")))
    title = "asyncrl comparison: " + ", ".join(run_label(r) for r in runs)
    return _PAGE.format(title=html.escape(title), run_dir=html.escape(", ".join(str(r.run_dir) for r in runs)),
                        steps=" / ".join(str(len(r.rows)) for r in runs),
                        mode=" / ".join(run_profile(r).get("mode", "sync") for r in runs),
                        body="\n".join(sections))


def write_comparison(run_dirs: Sequence[Path], output: Optional[Path] = None) -> Path:
    """Render the comparison of ``run_dirs``; returns its path (default FIRST_RUN/compare.html)."""
    runs = [load_run(Path(d)) for d in run_dirs]
    output = Path(output) if output else runs[0].run_dir / COMPARE_NAME
    output.write_text(render_comparison(runs))
    return output


def _arrow(before, after) -> str:
    if before is None or after is None:
        return "-"
    return f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f})"
