"""Which logged metrics measure the machine rather than the learning.

Wall times, throughput, memory, FLOPs per second, and what depends on thread timing in async
mode (queue depths, version lag, staleness) differ between two runs of the same config and seed;
every other metric of a deterministic run (sync, or async with ``max_staleness=0``) repeats bit
for bit. Resume tests and the fault-injection bench compare runs on ``learning_metrics(row)``.
"""
from __future__ import annotations

from typing import Mapping

#: Key prefixes of the metrics that measure time, memory or thread timing.
TIMING_PREFIXES = ("time/", "share/", "throughput/", "memory/", "profile/", "weight_sync/", "async/overlap",
                   "async/rollout_seconds", "async/trainer_busy_seconds", "async/window_seconds",
                   "async/running_groups", "async/buffer_groups", "async/version_lag", "async/staleness_",
                   "health/throughput_drop",
                   "actor/tflops", "actor/mfu")  # FLOPs per wall second


def learning_metrics(row: Mapping[str, object]) -> dict:
    """``row`` without its timing metrics: what equals between two runs of one seed."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}
