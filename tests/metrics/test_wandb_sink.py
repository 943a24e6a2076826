"""The W&B sink in offline mode: a run is written under RUN_DIR/wandb with our metrics in it."""
from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("wandb", reason="wandb not installed (pip install wandb)")

from asyncrl.metrics.wandb_sink import WandbSink  # noqa: E402


def test_offline_run_records_metrics_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "20261129-000000-quickstart"
    run_dir.mkdir()
    sink = WandbSink(run_dir, project="asyncrl-test", config={"trainer": {"steps": 3}})
    for step in range(1, 4):
        # strings (the JSONL sink's "nan") are dropped; float NaN is kept, W&B shows it
        sink.write(step, {"reward/mean": 0.1 * step, "actor/pg_loss": math.nan, "note": "text"})
    sink.write_summary({"final_accuracy": 0.5, "stage_seconds": {"rollout": 1.5}, "checkpoint": "x"})
    assert sink.run.summary["reward/mean"] == pytest.approx(0.3)
    assert sink.run.summary["stage_seconds/rollout"] == pytest.approx(1.5)
    assert "note" not in dict(sink.run.summary)
    sink.close()
    [record] = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    data = _wait_for(record, b"final_accuracy")  # protobuf records; keys are stored as plain strings
    assert b"reward/mean" in data and b"final_accuracy" in data
    assert record.stem == "run-20261129-000000-quickstart"  # id from the run dir: resumes continue it


def _wait_for(path, needle: bytes, timeout: float = 20.0) -> bytes:
    """The file's bytes once ``needle`` is in them: offline ``finish()`` can return before
    wandb's service process has flushed the record file."""
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes()
        if needle in data or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbSink(tmp_path)
