"""Per-stage peak memory: RSS on CPU (exact where /proc/self/clear_refs resets VmHWM), and
torch's allocator on CUDA."""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from asyncrl.metrics.memory import MIB, MemoryTracker, rss_bytes

ALLOC_MIB = 64


def _touch(mib: int) -> float:
    """Write every page of a fresh anonymous mapping, unmapped on return. Fresh pages: a malloc'd
    block can reuse memory that an earlier test freed and the allocator kept resident, which
    raises no RSS peak (seen after tests/workflows in one single-threaded test process)."""
    with mmap.mmap(-1, mib * MIB) as block:
        pages = np.frombuffer(block, dtype=np.uint8)
        pages[:] = 1
        value = float(pages[-1])
        del pages  # the mapping closes only when no array views it
    return value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS peaks are read from /proc")
def test_cpu_peak_per_stage_sees_a_freed_allocation():
    tracker = MemoryTracker("cpu")
    tracker.start_step()
    with tracker.stage("big"):
        _touch(ALLOC_MIB)  # freed before the stage ends: only a peak can see it
    with tracker.stage("small"):
        pass
    metrics = tracker.step_metrics()
    assert tracker.kind == "rss"
    big, small = metrics["memory/big_peak_mib"], metrics["memory/small_peak_mib"]
    if tracker.exact:  # the high-water mark was reset before "small", so it misses the block
        assert big - small > 0.8 * ALLOC_MIB
    assert big >= rss_bytes() / MIB * 0.5
    assert metrics["memory/peak_mib"] == max(big, small)
    assert tracker.summary()["peak_mib"]["big"] == big


def test_disabled_tracker_reports_nothing():
    tracker = MemoryTracker("cpu", enabled=False)
    with tracker.stage("rollout"):
        pass
    assert tracker.step_metrics() == {}


def test_run_peak_is_max_over_steps():
    tracker = MemoryTracker("cpu")
    for _ in range(2):
        tracker.start_step()
        with tracker.stage("rollout"):
            pass
    assert set(tracker.step_metrics()) == {"memory/rollout_peak_mib", "memory/peak_mib"}
    assert tracker.summary()["peak_mib"]["rollout"] > 0


@pytest.mark.gpu
def test_cuda_peak_per_stage():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tracker = MemoryTracker("cuda")
    tracker.start_step()
    with tracker.stage("big"):
        block = torch.empty(ALLOC_MIB * MIB, dtype=torch.uint8, device="cuda")
        del block
    with tracker.stage("small"):
        pass
    metrics = tracker.step_metrics()
    assert tracker.kind == "gpu_allocated"
    assert metrics["memory/big_peak_mib"] - metrics["memory/small_peak_mib"] >= ALLOC_MIB
