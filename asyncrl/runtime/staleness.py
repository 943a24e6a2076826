"""Admission control that bounds staleness (AReaL's rule), and per-sample staleness.

Units are *groups* (one prompt and its n samples); B = ``trainer.prompts_per_step`` groups
make one trainer batch; η = ``runtime.max_staleness``; v = the policy version of the
weights the rollout backend holds when the group is admitted.

Admission (AReaL ``areal/infra/staleness_manager.py``)::

    capacity = min(max_concurrent − running, (η + v + 1)·B − (accepted + running))

Invariant: let c = accepted + running when a group is admitted; it is admitted only while
c < (η + v + 1)·B. Groups get increasing ids and the trainer takes them in id order, skipping
released ones (buffer.py). If a group is trained in batch j (trainer version j), the jB groups
trained before it have smaller ids and were never released, so each was running or accepted
at its admission: c ≥ jB. Hence jB < (η + v + 1)·B, and every token of the group satisfies

    staleness = j − version(token) ≤ j − v ≤ η.

Nothing is discarded to keep the bound: new work is throttled before it starts. A group that
fails (timed out, dropped) is ``release``d: it leaves ``running`` without entering
``accepted``, so its admission slot is reused.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch


class StalenessManager:
    """Thread-safe admission counter. ``admit`` is called by the rollout side,
    ``accept``/``release`` when a group finishes, ``set_version`` after each weight sync."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int, version: int = 0):
        if batch_size < 1 or max_staleness < 0 or max_concurrent < 1:
            raise ValueError(f"need batch_size >= 1, max_staleness >= 0, max_concurrent >= 1; got "
                             f"{batch_size}, {max_staleness}, {max_concurrent}")
        self.batch_size, self.max_staleness, self.max_concurrent = batch_size, max_staleness, max_concurrent
        self.version, self.accepted, self.running, self.released = version, 0, 0, 0
        self.next_id = 0  # ids of admitted groups: 0, 1, 2 ... in admission order
        self._cond = threading.Condition()

    def capacity(self) -> int:
        """Groups that may start now (the formula in the module docstring; never < 0)."""
        with self._cond:
            return self._capacity()

    def _capacity(self) -> int:
        bound = (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running)
        return max(0, min(self.max_concurrent - self.running, bound))

    def admit(self, wanted: int, timeout: Optional[float] = None) -> range:
        """Admit up to ``wanted`` groups, waiting up to ``timeout`` s for capacity (None: forever);
        returns the ids of the admitted groups (empty on timeout). They count as running."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._capacity() > 0, timeout):
                return range(0)
            n = min(wanted, self._capacity())
            self.running += n
            self.next_id += n
            return range(self.next_id - n, self.next_id)

    def accept(self, n: int = 1) -> None:
        """n running groups finished and entered the buffer."""
        with self._cond:
            self._check_running(n)
            self.running -= n
            self.accepted += n
            self._cond.notify_all()

    def release(self, n: int = 1) -> None:
        """n running groups were dropped (timeout, failure): their slots are freed."""
        with self._cond:
            self._check_running(n)
            self.running -= n
            self.released += n
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The rollout backend now holds weights of ``version`` (called after each sync)."""
        with self._cond:
            if version < self.version:
                raise ValueError(f"policy version went back from {self.version} to {version}")
            self.version = version
            self._cond.notify_all()

    def resume_at(self, version: int) -> None:
        """A resumed run at trainer version ``version``, before any admission: count the
        ``version`` batches trained before the checkpoint as accepted, so the capacity is
        (η + 1)·B as at a fresh start and the bound's proof (c ≥ jB) carries over."""
        with self._cond:
            if self.running or self.next_id:
                raise RuntimeError("resume_at must come before the first admission")
            self.version, self.accepted = version, version * self.batch_size

    def wake(self) -> None:
        """Wake waiters (used on shutdown, together with a zero timeout)."""
        with self._cond:
            self._cond.notify_all()

    def _check_running(self, n: int) -> None:
        if n > self.running:
            raise RuntimeError(f"{n} groups finished but only {self.running} were running")


def sample_staleness(trainer_version: int, token_versions: torch.Tensor) -> torch.Tensor:
    """[B] staleness per sample = trainer version − the oldest version among its tokens.

    token_versions: [B, L], −1 on padding. A row with no tokens has staleness 0.
    """
    real = token_versions >= 0
    big = torch.iinfo(token_versions.dtype).max
    oldest = torch.where(real, token_versions, torch.full_like(token_versions, big)).min(-1).values
    oldest = torch.where(real.any(-1), oldest, torch.full_like(oldest, trainer_version))
    return trainer_version - oldest


def staleness_metrics(trainer_version: int, token_versions: torch.Tensor, max_staleness: int,
                      rollout_version: int) -> dict[str, float]:
    """``async/staleness_mean|max``, ``async/staleness_violations`` (samples over the bound: must
    stay 0), ``async/staleness_hist/<k>`` (samples whose staleness is k, for k = 0 .. the step's
    max: the report's histogram) and ``async/version_lag`` (trainer version − rollout weights'
    version)."""
    staleness = sample_staleness(trainer_version, token_versions)
    s = staleness.float()
    hist = torch.bincount(staleness.clamp(min=0).long()).tolist()
    return {"async/staleness_mean": float(s.mean()), "async/staleness_max": float(s.max()),
            "async/staleness_violations": float((s > max_staleness).sum()),
            **{f"async/staleness_hist/{k}": float(count) for k, count in enumerate(hist)},
            "async/version_lag": float(trainer_version - rollout_version)}
