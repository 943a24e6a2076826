"""Weights & Biases sink: the same ``write(step, metrics)`` / ``close()`` shape as the JSONL
and TensorBoard sinks, used only when configured (``logging.wandb: true``).

``wandb`` is imported lazily and is not a dependency of asyncrl: asking for this sink
without it installed is a clear error naming the install command. ``mode`` follows wandb
("online", "offline", "disabled"); None leaves it to ``WANDB_MODE`` (tests use "offline",
which writes the run under ``RUN_DIR/wandb/`` for a later ``wandb sync``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence


class WandbSink:
    """Logs each step's numeric metrics to one W&B run whose files live in ``RUN_DIR/wandb``."""

    def __init__(self, run_dir: Path, project: str = "asyncrl", name: Optional[str] = None,
                 config: Optional[Mapping] = None, mode: Optional[str] = None, entity: Optional[str] = None,
                 tags: Sequence[str] = ()):
        try:
            import wandb
        except ImportError as err:
            raise ImportError("logging.wandb=true needs the wandb package: pip install wandb") from err
        run_dir = Path(run_dir)
        self.run = wandb.init(project=project, name=name or run_dir.name, config=dict(config or {}),
                              dir=str(run_dir), mode=mode, entity=entity, tags=list(tags),
                              id=_run_id(run_dir), resume="allow")
        # Every curve is plotted against the RL step, not wandb's own call counter.
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        row["step"] = step
        self.run.log(row, step=step, commit=True)  # flush now: a crash mid-run loses no step

    def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
        """Sampled completions as a ``wandb.Table`` (prompt, response, reward)."""
        import wandb

        table = wandb.Table(columns=["prompt", "response", "reward"],
                            data=[[s["prompt"], s["response"], s["reward"]] for s in samples])
        self.run.log({tag: table}, step=step, commit=False)  # the step's scalars commit it

    def write_summary(self, summary: Mapping) -> None:
        """Copy the run's summary.json scalars into the W&B run summary."""
        for key, value in _flatten(summary).items():
            if _is_number(value) or isinstance(value, str):
                self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()


def _run_id(run_dir: Path) -> str:
    """A W&B run id from the run directory's name, so a resumed run continues the same W&B run."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.name)[-64:] or "asyncrl"


def _flatten(tree: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN/Inf included: W&B shows them
