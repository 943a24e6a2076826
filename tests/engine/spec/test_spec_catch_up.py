"""bench/spec_catch_up.py at CPU size: the GPU command's code path (random models saved and loaded,
the gate's catch-up steps timed, compiled glue on and off in child processes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "spec_catch_up.py"


def test_every_catch_up_step_is_timed_for_both_proposers(tmp_path):
    spec = importlib.util.spec_from_file_location("spec_catch_up", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "catch_up.json"
    assert bench.main(["--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["compile"]) for r in rows] == [("draft_model", "1"), ("draft_model", "0"),
                                                           ("eagle", "1"), ("eagle", "0")]
    for row in rows:
        assert "error" not in row, row.get("error")
        # the timed run's new sequences catch up on their prompts at least once, each step timed
        assert row["catch_ups"] and all(c["tokens"] > 0 and c["ms"] > 0 for c in row["catch_ups"])
