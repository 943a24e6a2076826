"""The rollout fleet's part of the stage profile: how busy each replica was, and how many
replicas the trainer could feed (Amdahl's law for the rollout side of the async runtime).

Per step the fleet reports ``fleet/busy_replica_seconds`` (seconds each replica had a call in
flight, summed over replicas) and the async controller ``async/trainer_busy_seconds``. Over the
run, with G = busy replica-seconds per step and T = trainer seconds per step, R replicas
generate a step's groups in at least G / R seconds, which the trainer hides while G / R <= T:

    replicas the trainer can feed  R* = G / T

Below R* the step is rollout-bound (another replica shortens it); above it the extra replicas
wait for the trainer (a faster trainer, not more replicas, would help). G is measured at the
current replica count: replicas that share a GPU or CPU cores make each other slower, so R* is
an estimate for replicas on their own devices.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

from asyncrl.metrics.members import member_values


@dataclass
class FleetProfile:
    """Cumulative fleet metrics of a run, fed the metrics dict of every step."""

    steps: int = 0
    replica_seconds: float = 0.0
    trainer_seconds: float = 0.0
    replicas: int = 0
    lost: int = 0
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def observe(self, metrics: Mapping[str, float]) -> None:
        if "fleet/busy_replica_seconds" not in metrics:
            return
        self.steps += 1
        self.replica_seconds += metrics["fleet/busy_replica_seconds"]
        self.trainer_seconds += metrics.get("async/trainer_busy_seconds", 0.0)
        self.replicas = max(self.replicas, int(metrics["fleet/replicas_alive"] + metrics["fleet/replicas_lost"]))
        self.lost = int(metrics["fleet/replicas_lost"])
        for replica, value in member_values(metrics, "fleet", "busy").items():
            self.busy[replica] += value

    @property
    def active(self) -> bool:
        return self.steps > 0

    def feedable_replicas(self) -> float:
        """R* = G / T (inf when the trainer took no time)."""
        return self.replica_seconds / self.trainer_seconds if self.trainer_seconds > 0 else float("inf")

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {"replicas": self.replicas, "lost": self.lost,
                "busy": {name: total / steps for name, total in sorted(self.busy.items())},
                "replica_seconds_per_step": self.replica_seconds / steps,
                "trainer_seconds_per_step": self.trainer_seconds / steps,
                "feedable_replicas": self.feedable_replicas()}

    def line(self) -> str:
        """e.g. ``fleet: 2 replicas, busy 97% / 95%; rollout 3.10 replica-s per step vs trainer
        1.02 s: the trainer could feed 3.0 replicas (rollout-bound: more replicas would help)``."""
        s = self.summary()
        busy = " / ".join(f"{100 * b:.0f}%" for b in s["busy"].values())
        feed = s["feedable_replicas"]
        running = self.replicas - self.lost
        verdict = ("rollout-bound: more replicas would help" if feed > running else
                   "trainer-bound: more replicas would wait for the trainer")
        lost = f" ({self.lost} lost)" if self.lost else ""
        return (f"fleet: {self.replicas} replicas{lost}, busy {busy}; rollout {s['replica_seconds_per_step']:.2f} "
                f"replica-s per step vs trainer {s['trainer_seconds_per_step']:.2f} s: the trainer could feed "
                f"{feed:.1f} replicas ({verdict})")
