"""The staleness bound under randomized schedules: admission (staleness.py) + admission-order
consumption (buffer.py) never trains a group more than η versions after its weights."""
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrl.runtime.buffer import RolloutBuffer, ScoredGroup
from asyncrl.runtime.staleness import StalenessManager, sample_staleness, staleness_metrics
from asyncrl.types import Completion, Example, RequestOutput


def group(gid: int, version: int) -> ScoredGroup:
    out = RequestOutput([1], None, [Completion([5], "x", [0.0], "stop", [version])])
    return ScoredGroup(Example("p", "a"), out, [0.0], [0.0], gid, version)


class AsyncSchedule(RuleBasedStateMachine):
    """Rollout admits, groups finish or are dropped in any order, the trainer takes B groups
    whenever the buffer has the next B in admission order, and syncs every ``sync_every``."""

    def __init__(self):
        super().__init__()
        self.configured = False

    @precondition(lambda self: not self.configured)
    @rule(batch=st.integers(1, 4), eta=st.integers(0, 3), concurrent=st.integers(1, 12), sync_every=st.integers(1, 3))
    def configure(self, batch, eta, concurrent, sync_every):
        sync_every = min(sync_every, eta + 1)  # validate.py refuses sync_every − 1 > η (it would deadlock)
        self.B, self.eta, self.sync_every = batch, eta, sync_every
        self.manager = StalenessManager(batch, eta, concurrent)
        self.buffer = RolloutBuffer(capacity=(eta + 1) * batch)
        self.running: dict[int, int] = {}  # id -> version of the weights that generate it
        self.trainer_version = 0
        self.trained = []  # (trainer version, generating version)
        self.configured = True

    @precondition(lambda self: self.configured)
    @rule(wanted=st.integers(1, 5))
    def admit(self, wanted):
        for gid in self.manager.admit(wanted, timeout=0):
            self.running[gid] = self.manager.version

    @precondition(lambda self: self.configured and self.running)
    @rule(pick=st.integers(0, 10**6), drop=st.booleans())
    def finish(self, pick, drop):
        gid = sorted(self.running)[pick % len(self.running)]
        version = self.running.pop(gid)
        if drop:
            self.manager.release()
            self.buffer.release(gid)
        else:
            self.manager.accept()
            self.buffer.put(group(gid, version))

    @precondition(lambda self: self.configured)
    @rule()
    def train(self):
        if not self.buffer.ready(self.B):
            return
        for g in self.buffer.take(self.B):
            self.trained.append((self.trainer_version, g.oldest_version))
        self.trainer_version += 1
        if self.trainer_version % self.sync_every == 0:
            self.manager.set_version(self.trainer_version)

    @invariant()
    def bound_holds(self):
        if self.configured:
            assert all(tv - gv <= self.eta for tv, gv in self.trained), (self.eta, self.trained)
            assert len(self.buffer) <= (self.eta + 1) * self.B
            assert self.manager.running == len(self.running)

    @invariant()
    def on_policy_when_eta_zero(self):
        if self.configured and self.eta == 0:
            assert all(tv == gv for tv, gv in self.trained)


TestAsyncSchedule = AsyncSchedule.TestCase
TestAsyncSchedule.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_capacity_formula_by_hand():
    # B=4, η=1, v=0: (1+0+1)·4 − 0 = 8, capped by max_concurrent − running = 6
    m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=6)
    assert m.capacity() == 6
    assert list(m.admit(10)) == [0, 1, 2, 3, 4, 5]
    m.accept(6)                            # running 0, accepted 6: min(6, 8 − 6) = 2
    assert m.capacity() == 2
    m.set_version(1)                       # min(6, 12 − 6) = 6
    assert m.capacity() == 6


def test_eta_zero_admits_exactly_one_batch_per_version():
    m = StalenessManager(batch_size=3, max_staleness=0, max_concurrent=100)
    assert len(m.admit(100)) == 3 and m.capacity() == 0
    m.accept(3)
    assert m.capacity() == 0              # nothing more until the trainer's weights arrive
    m.set_version(1)
    assert len(m.admit(100)) == 3


def test_admit_waits_for_a_version_bump_from_another_thread():
    m = StalenessManager(batch_size=1, max_staleness=0, max_concurrent=4)
    m.admit(1)
    m.accept()
    threading.Timer(0.05, m.set_version, args=(1,)).start()
    assert list(m.admit(1, timeout=5)) == [1]


def test_released_slots_are_reused_and_skipped_by_the_trainer():
    m, buf = StalenessManager(2, 0, 10), RolloutBuffer(2)
    ids = list(m.admit(2))
    m.release()
    buf.release(ids[0])
    assert list(m.admit(5)) == [2]        # the dropped group's slot, under a new id
    m.accept(2)
    buf.put(group(ids[1], 0))
    buf.put(group(2, 0))
    assert [g.admit_index for g in buf.take(2)] == [1, 2]


def test_sample_staleness_uses_the_oldest_token():
    versions = torch.tensor([[3, 4, -1], [5, 5, 5], [-1, -1, -1]])
    # trainer at 5: row 0 oldest 3 -> 2; row 1 -> 0; empty row -> 0
    assert sample_staleness(5, versions).tolist() == [2, 0, 0]
    m = staleness_metrics(5, versions, max_staleness=1, rollout_version=4)
    assert m["async/staleness_max"] == 2 and m["async/staleness_violations"] == 1
    assert m["async/staleness_mean"] == pytest.approx(2 / 3) and m["async/version_lag"] == 1
    # staleness 2, 0, 0: two samples at 0 versions, none at 1, one at 2 (the report's histogram)
    assert [m[f"async/staleness_hist/{k}"] for k in range(3)] == [2.0, 0.0, 1.0]
