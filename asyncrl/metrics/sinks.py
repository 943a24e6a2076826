"""Where metrics go: a JSONL file (always), TensorBoard (when enabled).

Besides scalars, each sink takes a few sampled completions per held-out eval
(``write_samples``): ``samples.jsonl`` in the run directory, a text table in TensorBoard,
a ``wandb.Table`` in W&B; the report shows them under each eval.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible rather than dropping them
    return value


SAMPLES_FILE = "samples.jsonl"


def samples_markdown(samples: list[dict]) -> str:
    """A markdown table of (prompt, response, reward) rows, as TensorBoard renders text."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")
    lines = ["| prompt | response | reward |", "|---|---|---|"]
    lines += [f"| {cell(s['prompt'])} | {cell(s['response'])} | {s['reward']:g} |" for s in samples]
    return "\n".join(lines)


class JsonlSink:
    """Appends one JSON object per step to ``metrics.jsonl``; flushed every write.
    Sampled completions go to ``samples.jsonl``, one object per sample."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / SAMPLES_FILE
        self._file = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")

    def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
        with open(self.samples_path, "a") as fh:
            for sample in samples:
                fh.write(json.dumps({"step": step, "tag": tag, **sample}) + "\n")

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

    def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
        self._writer.add_text(tag, samples_markdown(samples), step)

    def close(self) -> None:
        self._writer.close()


class MetricSinks:
    """Fan-out to every configured sink."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_step: int | None = None):
        self.sinks = [JsonlSink(run_dir)] + ([TensorBoardSink(run_dir, purge_step)] if tensorboard else [])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
        """A few sampled completions (``prompt``, ``response``, ``reward``) under ``tag``."""
        for sink in self.sinks:
            getattr(sink, "write_samples", lambda *a: None)(step, tag, samples)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
