"""The metrics tools on real runs of ``asyncrl train``.

- fast: a few steps of the shrunken quickstart; the report renders and every image loads.
- slow: the quickstart itself (20 steps, eval every 5): a healthy run in which no health
  monitor fires, and whose report renders.
"""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (pip install asyncrl[report])")

from asyncrl.config import load_config  # noqa: E402
from asyncrl.metrics.health import read_events, replay  # noqa: E402
from asyncrl.metrics.report import write_report  # noqa: E402
from asyncrl.runtime.pipeline import run_training  # noqa: E402

from .test_report import _broken, _image_check  # noqa: E402

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=3",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=8", "logging.progress=false",
        "logging.tensorboard=false"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_report_of_a_real_run_loads_in_chromium(tmp_path):
    run_dir = tmp_path / "run"
    run_training(load_config("quickstart", FAST + [f"logging.run_dir={run_dir}", f"sft.cache_dir={tmp_path / 'cache'}",
                                                   "trainer.eval_every=3", "algorithm.kl_coef=0.05"]))
    page = write_report(run_dir).read_text()
    for alt in ("reward and accuracy", "KL", "entropy", "response length", "stage time stacked area"):
        assert f'alt="{alt}"' in page
    # the Amdahl headline from real stage times (whichever stage is the bottleneck; HTML-escaped)
    assert re.search(r"\w+ is \d+% of the step: 5x faster \w+ -&gt; step", page)
    assert _broken(_image_check(page, tmp_path)) == []


@pytest.mark.slow
def test_healthy_quickstart_fires_no_monitor(quickstart_run):
    """The default recipe, as a user runs it (the session's one quickstart run)."""
    run_dir, summary = quickstart_run
    rows = _rows(run_dir)
    assert len(rows) == summary["steps"] and any("eval/accuracy" in r for r in rows)
    monitor = replay(rows)  # the monitors over the run's own metrics, default thresholds
    fired = {e.monitor for e in monitor.events}
    # On a quiet machine nothing fires. The one monitor that may, throughput_drop, reports the
    # machine rather than the learning: then it must coincide with rollouts really slowed down.
    assert fired <= {"throughput_drop"}, [e.message for e in monitor.events]
    if fired:
        times = sorted(r["time/rollout"] for r in rows)
        assert times[-1] > 3 * times[len(times) // 2], [e.message for e in monitor.events]
    active = {k for k, v in monitor.step_metrics().items() if k.startswith("health/") and not k.endswith(("_count", "_total"))}
    assert {"health/reward_hacking", "health/degenerate_groups", "health/entropy_collapse", "health/nonfinite",
            "health/throughput_drop"} <= active  # they were watching, not absent
    live = read_events(run_dir / "health_events.jsonl")  # once the loop logs events live
    assert {e.monitor for e in live} <= {"throughput_drop"}
    assert "Health" in write_report(run_dir).read_text()
