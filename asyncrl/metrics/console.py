"""What the terminal shows: a rich progress bar with ETA and a closing summary table."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(highlight=False)


class StepProgress:
    """A progress bar over RL steps showing reward and accuracy; inert when disabled."""

    def __init__(self, total: int, enabled: bool = True, completed: int = 0):
        """``completed``: steps done before (a resumed run)."""
        self.enabled = enabled and total > completed
        self._progress = Progress(
            TextColumn("[bold]RL[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
        self._task = self._progress.add_task("rl", total=total, completed=completed, info="")

    def __enter__(self):
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._progress.stop()

    def advance(self, metrics: dict[str, float]) -> None:
        if self.enabled:
            info = f"reward {metrics.get('reward/mean', 0.0):.3f}  step {metrics.get('time/step', 0.0):.2f}s"
            self._progress.update(self._task, advance=1, info=info)


def summary_table(summary: dict) -> Table:
    table = Table(title="asyncrl run summary", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("steps", "wall_seconds", "sft_accuracy", "final_accuracy", "accuracy_gain"):
        if key in summary and summary[key] is not None:
            value = summary[key]
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    total = sum(summary.get("stage_seconds", {}).values()) or 1.0
    for stage, seconds in summary.get("stage_seconds", {}).items():
        table.add_row(f"stage {stage}", f"{seconds:.1f}s ({100 * seconds / total:.0f}%)")
    return table
