"""A fleet of two engine replicas (processes) serves one async run behind the rollout-backend
protocol: 0 staleness violations, every replica on the same version after every sync and
probed, groups spread over both; then one replica is killed: its groups are generated again on
the other, the run goes on, and every admitted group is trained exactly once, in order. With
``runtime.max_restarts`` > 0 a killed replica is restarted instead (issue 18's restarts, per
replica): none is lost and its groups in flight come back from the new process."""
import os
import signal
from collections import Counter
from typing import Callable

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data.tasks import build_task
from asyncrl.metrics.health import HealthMonitor
from asyncrl.rollout.fleet import Fleet
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.pipeline import prepare_policy

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.prompts_per_step=4",
        "rollout.n=4", "task.num_eval=16", "logging.progress=false", "logging.tensorboard=false",
        "runtime.mode=async", "runtime.max_staleness=1", "algorithm.decoupled=true",
        "algorithm.rollout_correction.level=token", "rollout.engines=2", "runtime.rollout_workers=2"]
STEPS, RESTART_AT, KILL_AT = 6, 2, 4


def length_reward(prompt, response, **fields):
    return float(len(response) % 2)


def kill_on_next_call(replica):
    """The replica's process is killed when the fleet next sends it groups (they are then in
    flight on it: exactly what a crash mid-generation leaves)."""
    generate, killed = replica.generate, []

    def die_then_generate(prompts, params):
        if not killed:
            killed.append(len(prompts))
            os.kill(replica.process.pid, signal.SIGKILL)
            replica.process.join(10)
        return generate(prompts, params)
    replica.generate = die_then_generate
    return killed


def count_probes(fleet) -> Counter:
    probed = Counter()
    for i, replica in enumerate(fleet.replicas):
        def run_probe(probe, version, i=i, run=replica.run_probe):
            probed[i] += 1
            return run(probe, version)
        replica.run_probe = run_probe
    return probed


def run_restarting_then_losing_replica_1(ctrl, steps: int, restart_at: int, kill_at: int, kill_on_next_call,
                                         replaced: Callable[[], bool]) -> tuple[dict, list, list]:
    """Steps 1..``steps`` of an async run on a fleet of 2 replicas with ``runtime.max_restarts=1``:
    replica 1 is killed when next called from step ``restart_at`` (restarted: ``replaced()``
    says it runs in a new process or actor) and again from ``kill_at`` (lost). After every step:
    0 staleness violations, the probe run on every live replica (gap < 1e-3), every live replica
    on the step's version. Returns (the last step's metrics, the second kill's record, the steps
    of ``replica_lost`` events). Shared by the process and Ray fleets' tests."""
    fleet, health, restarted, killed, lost_events, metrics = ctrl.backend, HealthMonitor(), [], [], [], {}
    probed = count_probes(fleet)
    for step in range(1, steps + 1):
        if step == restart_at:
            restarted = kill_on_next_call(fleet.replicas[1])
        if step == kill_at:
            assert restarted and fleet.lost == [] and fleet.replicas[1].restarts == 1
            assert replaced() and fleet.replicas[1].is_alive()
            # the last step's metrics were read before or after the restart (the rollout thread restarts
            # the replica on its own time); the final step's must count it (below)
            assert metrics["async/rollout_restarts"] <= 1 and metrics["fleet/replicas_lost"] == 0
            assert all(s.tokens > 0 for s in fleet.stats)  # both replicas generated
            assert probed == {0: kill_at - 1, 1: kill_at - 1}  # every sync probed on every replica
            killed = kill_on_next_call(fleet.replicas[1])  # no restart left: lost
        metrics = ctrl.step(step)
        metrics.update(ctrl.weight_sync.wait())  # this step's push: acked by every live replica, probed
        assert metrics["async/staleness_violations"] == 0 and metrics["weight_sync/probe_gap"] < 1e-3
        live = [0] if fleet.lost else [0, 1]
        assert fleet.version == step and fleet.replica_versions() == dict.fromkeys(live, step)
        lost_events += [step for e in health.observe(step, metrics) if e.monitor == "replica_lost"]
    assert metrics["async/rollout_restarts"] == 1  # the restart, counted once (the loss is not a restart)
    return metrics, killed, lost_events


@pytest.mark.slow
def test_two_replicas_serve_an_async_run_restart_a_killed_one_then_survive_losing_it(tmp_path, monkeypatch):
    """One fleet for both failure paths (each fleet start costs two replica processes):
    ``runtime.max_restarts=1``, so replica 1 killed at step ``RESTART_AT`` is restarted (none
    lost, its groups in flight come back from the new process) and killed again at ``KILL_AT``
    is lost (its groups generated again on replica 0)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("quickstart", FAST + [f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path}",
                                            "runtime.max_restarts=1"])
    task = build_task(cfg.task, cfg.seed)
    model, tok = prepare_policy(cfg, task, torch.device("cpu"), announce=False)[:2]
    ctrl = build_async_controller(cfg, model, tok, length_reward, task.train_stream(0), log_dir=tmp_path / "logs")
    fleet, trained = ctrl.backend, []
    take = ctrl.buffer.take
    ctrl.buffer.take = lambda n, check=None: [trained.append(g.admit_index) or g for g in take(n, check=check)]
    try:
        assert isinstance(fleet, Fleet) and len({r.process.pid for r in fleet.replicas} | {os.getpid()}) == 3
        first_pid = fleet.replicas[1].process.pid
        metrics, killed, lost_events = run_restarting_then_losing_replica_1(
            ctrl, STEPS, RESTART_AT, KILL_AT, kill_on_next_call, lambda: fleet.replicas[1].process.pid != first_pid)
        assert killed and fleet.lost == [1] and fleet.regenerated_groups >= killed[0] > 0
        assert len(lost_events) == 1 and lost_events[0] >= KILL_AT  # one health event, when it happened
        assert metrics["fleet/replicas_alive"] == 1 and metrics["fleet/replicas_lost"] == 1
        # no group lost, none trained twice: the trained ids are exactly the admission order
        assert trained == list(range(STEPS * 4)) and ctrl.staleness.released == 0
        assert (tmp_path / "logs" / "replica1.log").exists()
    finally:
        ctrl.close()
    assert not any(r.process.is_alive() for r in fleet.replicas)
