"""Peak memory per stage: GPU bytes allocated by torch on CUDA, process RSS on CPU.

Used beside the stage timer::

    with timer.stage("rollout"), memory.stage("rollout"):
        ...
    metrics.update(memory.step_metrics())   # memory/<stage>_peak_mib, memory/peak_mib

How a *per-stage* peak is measured:
- CUDA: ``torch.cuda.reset_peak_memory_stats`` on entry, ``max_memory_allocated`` on exit.
- CPU (Linux): the kernel's high-water mark ``VmHWM`` in ``/proc/self/status`` is reset on
  entry by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) and read on exit.
  Where that reset is refused, the peak falls back to ``max(RSS on entry, RSS on exit)``,
  a lower bound (``exact`` is then False), since ``resource.getrusage``'s ``ru_maxrss`` is
  a lifetime maximum that cannot be reset.
No psutil: the stdlib and /proc are enough, and psutil is not a dependency of asyncrl.
"""
from __future__ import annotations

import resource
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

MIB = 1024 * 1024
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def rss_bytes() -> int:
    """Current resident set size of this process (0 when unknown)."""
    return _status_field("VmRSS:")


def rss_peak_bytes() -> int:
    """Peak RSS since the last :func:`reset_rss_peak` (or process start)."""
    peak = _status_field("VmHWM:")
    if peak:
        return peak
    # No /proc (macOS): ru_maxrss is a lifetime peak, in bytes on macOS and KiB on Linux.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark; False where the kernel refuses."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _status_field(prefix: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(prefix):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemoryTracker:
    """Peak memory of each stage in the current step, and over the run.

    ``device`` is ``"cuda"`` (or ``"cuda:N"``) to track torch's GPU allocator, anything
    else to track this process's RSS. ``enabled=False`` makes every call a no-op, so the
    loop can call it unconditionally.
    """

    def __init__(self, device: str = "cpu", enabled: bool = True):
        self.device = str(device)
        self.enabled = enabled
        self.cuda = self.device.startswith("cuda") and _cuda_available()
        self.exact = True
        self.step_peak: dict[str, int] = {}
        self.run_peak: dict[str, int] = defaultdict(int)
        self.step_reserved: dict[str, int] = {}  # CUDA only: the caching allocator's reserved bytes
        self.run_reserved: dict[str, int] = defaultdict(int)

    @property
    def kind(self) -> str:
        """``gpu_allocated`` or ``rss``: what the bytes measure."""
        return "gpu_allocated" if self.cuda else "rss"

    def start_step(self) -> None:
        self.step_peak = {}
        self.step_reserved = {}

    @contextmanager
    def stage(self, name: str):
        """Record the peak bytes reached while the block runs, under ``name``."""
        if not self.enabled:
            yield
            return
        start = self._reset()
        try:
            yield
        finally:
            peak = max(self._peak(), start)
            self.step_peak[name] = max(self.step_peak.get(name, 0), peak)
            self.run_peak[name] = max(self.run_peak[name], peak)
            if self.cuda:
                import torch

                reserved = torch.cuda.max_memory_reserved(self.device)
                self.step_reserved[name] = max(self.step_reserved.get(name, 0), reserved)
                self.run_reserved[name] = max(self.run_reserved[name], reserved)

    def step_metrics(self) -> dict[str, float]:
        """``memory/<stage>_peak_mib`` per stage seen this step, and ``memory/peak_mib``."""
        if not self.step_peak:
            return {}
        metrics = {f"memory/{name}_peak_mib": peak / MIB for name, peak in self.step_peak.items()}
        metrics["memory/peak_mib"] = max(self.step_peak.values()) / MIB
        return metrics

    def summary(self) -> dict:
        """JSON-ready ``{"kind", "exact", "peak_mib": {stage: MiB}}`` for summary.json (on CUDA
        also ``reserved_peak_mib``: the allocator's reserved bytes, what the card must hold)."""
        summary = {"kind": self.kind, "exact": self.exact,
                   "peak_mib": {name: peak / MIB for name, peak in self.run_peak.items()}}
        if self.cuda:
            summary["reserved_peak_mib"] = {name: peak / MIB for name, peak in self.run_reserved.items()}
        return summary

    def _reset(self) -> int:
        """Reset the peak counter; returns the bytes in use now."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if not reset_rss_peak():
            self.exact = False
        return rss_bytes()

    def _peak(self) -> int:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device)
        return rss_peak_bytes() if self.exact else rss_bytes()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
