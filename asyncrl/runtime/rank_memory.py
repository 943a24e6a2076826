"""Peak memory of every rank, by stage, for the metrics and the summary.

Rank 0's stages are the controller's (``MemoryTracker`` beside the stage timer). A follower
rank runs no controller: it measures each call it replays (lockstep.py) under the name of the
stage that call belongs to. ``gather`` brings every rank's peaks of the step to rank 0.
"""
from __future__ import annotations

from asyncrl.distributed.group import DataParallel
from asyncrl.distributed.lockstep import replicated
from asyncrl.metrics.memory import MIB, MemoryTracker

# a replayed call -> the controller stage it runs in
CALL_STAGES = {
    "actor.compute_logprobs": "old_logprobs",
    "reference.compute_logprobs": "ref_logprobs",
    "critic.compute_values": "reward",
    "actor.update": "actor_update",
    "critic.update": "critic_update",
    "weights.push": "weight_sync",
    "checkpoint.write": "checkpoint",
}


class RankMemory:
    """Every rank's memory peaks (MiB) by stage: of the current step and of the run."""

    def __init__(self, dp: DataParallel, tracker: MemoryTracker):
        self.dp, self.tracker = dp, tracker

    def stage(self, role: str, method: str):
        """A follower: measure one replayed call (a context manager)."""
        return self.tracker.stage(CALL_STAGES.get(f"{role}.{method}", f"{role}.{method}"))

    @replicated("memory")
    def gather_step(self) -> list[dict[str, dict[str, float]]]:
        """Every rank's ``{"allocated": {stage: MiB}, "reserved": {stage: MiB}}`` since its last
        ``gather_step``, in rank order (on every rank; reserved is empty off CUDA)."""
        peaks = {"allocated": {name: peak / MIB for name, peak in self.tracker.step_peak.items()},
                 "reserved": {name: peak / MIB for name, peak in self.tracker.step_reserved.items()}}
        if not self.dp.is_main:
            self.tracker.start_step()  # rank 0's controller starts its own steps
        return self.dp.gather_objects(peaks)

    @replicated("memory")
    def gather_run(self) -> list[dict]:
        """Every rank's ``MemoryTracker.summary()`` (run peaks by stage), in rank order."""
        return self.dp.gather_objects(self.tracker.summary())


def rank_memory_metrics(per_rank: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """``memory/rank<r>_peak_mib`` (and ``_reserved_mib`` on CUDA): each rank's largest stage
    peak of the step."""
    metrics = {}
    for rank, peaks in enumerate(per_rank):
        for kind, suffix in (("allocated", "peak_mib"), ("reserved", "reserved_mib")):
            if peaks[kind]:
                metrics[f"memory/rank{rank}_{suffix}"] = max(peaks[kind].values())
    return metrics
