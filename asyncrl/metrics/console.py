"""What the terminal shows: a rich progress bar with ETA and a closing summary table."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(highlight=False)


def rl_info(metrics: dict) -> str:
    """The RL progress bar's text: the step's mean reward and seconds."""
    return f"reward {metrics.get('reward/mean', 0.0):.3f}  step {metrics.get('time/step', 0.0):.2f}s"


class StepProgress:
    """A progress bar over steps (``label``: RL, SFT ...) whose text ``info(metrics)`` makes
    from each step's metrics (default: reward and step time); inert when disabled."""

    def __init__(self, total: int, enabled: bool = True, label: str = "RL", info=rl_info, completed: int = 0):
        """``completed``: steps done before (a resumed run)."""
        self.enabled = enabled and total > completed
        self.info = info
        self._progress = Progress(
            TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
        self._task = self._progress.add_task("rl", total=total, completed=completed, info="")

    def __enter__(self):
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._progress.stop()

    def print(self, text: str) -> None:
        """A line above the bar (rich keeps the bar at the bottom), printed when disabled too."""
        console.print(text)

    def advance(self, metrics: dict[str, float]) -> None:
        if self.enabled:
            self._progress.update(self._task, advance=1, info=self.info(metrics))


#: (label, summary.json key before RL, key after RL): the held-out accuracies a run reports.
ACCURACY_ROWS = (("held-out accuracy, greedy", "sft_accuracy", "final_accuracy"),
                 ("held-out accuracy, sampled (mean@k)", "sft_sampled_accuracy", "final_sampled_accuracy"))


def accuracy_rows(summary: dict) -> list[tuple[str, str]]:
    """``(label, "0.325 -> 0.454 (+12.9 points)")`` for each accuracy the run measured; the
    console's summary table and the report's headline both print these strings."""
    rows = []
    for label, before_key, after_key in ACCURACY_ROWS:
        before, after = summary.get(before_key), summary.get(after_key)
        if before is not None and after is not None:
            rows.append((label, f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)"))
    return rows


def summary_table(summary: dict) -> Table:
    """Steps, time and the held-out accuracies before/after RL (the stage profile is its own table)."""
    table = Table(title="asyncrl run summary", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("steps", "rl_seconds", "wall_seconds"):
        value = summary.get(key)
        if value is not None:
            table.add_row(key, f"{value:.1f}" if isinstance(value, float) else str(value))
    for label, text in accuracy_rows(summary):
        table.add_row(label, text)
    return table
