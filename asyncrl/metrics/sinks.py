"""Where metrics go: a JSONL file (always), TensorBoard (when enabled)."""
from __future__ import annotations

import json
import math
from pathlib import Path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible rather than dropping them
    return value


class JsonlSink:
    """Appends one JSON object per step to ``metrics.jsonl``; flushed every write."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, run_dir: Path, purge_step: int | None = None):
        """``purge_step``: a resumed run's first step; events of that step and later, left by
        the run it resumes, are hidden (TensorBoard's purge), so no step appears twice."""
        from torch.utils.tensorboard import SummaryWriter  # deferred: pulls in tensorboard

        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class MetricSinks:
    """Fan-out to every configured sink."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_step: int | None = None):
        self.sinks = [JsonlSink(run_dir)] + ([TensorBoardSink(run_dir, purge_step)] if tensorboard else [])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
