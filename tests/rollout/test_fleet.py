"""A fleet of two engine replicas (processes) serves one async run behind the rollout-backend
protocol: 0 staleness violations, every replica on the same version after every sync and
probed, groups spread over both; then one replica is killed: its groups are generated again on
the other, the run goes on, and every admitted group is trained exactly once, in order. With
``runtime.max_restarts`` > 0 a killed replica is restarted instead (issue 18's restarts, per
replica): none is lost and its groups in flight come back from the new process."""
import os
import signal
from collections import Counter

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
STEPS, KILL_AT = 6, 4


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


def run_losing_replica_1(ctrl, steps: int, kill_at: int | tuple, kill_on_next_call) -> tuple[dict, list, list]:
    """Steps 1..``steps`` of an async run on a fleet of 2 replicas; replica 1 is killed when next
    called from step ``kill_at`` on (each of them, if several). After every step: 0 staleness
    violations, the probe run on every live replica (gap < 1e-3), every live replica on the
    step's version. Returns (the last step's metrics, the last ``kill_on_next_call``'s record,
    the steps of ``replica_lost`` events)."""
    fleet, health, killed, lost_events = ctrl.backend, HealthMonitor(), [], []
    kills = (kill_at,) if isinstance(kill_at, int) else tuple(kill_at)
    probed = count_probes(fleet)
    for step in range(1, steps + 1):
        if step == kills[0]:
            assert all(s.tokens > 0 for s in fleet.stats)  # both replicas generated
            assert probed == {0: step - 1, 1: step - 1}  # every sync probed on every replica
        if step in kills:
            killed = kill_on_next_call(fleet.replicas[1])
        metrics = ctrl.step(step)
        metrics.update(ctrl.weight_sync.wait())  # this step's push: acked by every live replica, probed
        assert metrics["async/staleness_violations"] == 0 and metrics["weight_sync/probe_gap"] < 1e-3
        live = [0] if fleet.lost else [0, 1]
        assert fleet.version == step and fleet.replica_versions() == dict.fromkeys(live, step)
        lost_events += [step for e in health.observe(step, metrics) if e.monitor == "replica_lost"]
    return metrics, killed, lost_events


@pytest.mark.slow
def test_two_replicas_serve_an_async_run_and_survive_losing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("quickstart", FAST + [f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path}",
                                            "runtime.max_restarts=0"])  # a dead replica is lost, not restarted
    task = build_task(cfg.task, cfg.seed)
    model, tok = prepare_policy(cfg, task, torch.device("cpu"), announce=False)[:2]
    ctrl = build_async_controller(cfg, model, tok, length_reward, task.train_stream(0), log_dir=tmp_path / "logs")
    fleet, trained = ctrl.backend, []
    take = ctrl.buffer.take
    ctrl.buffer.take = lambda n, check=None: [trained.append(g.admit_index) or g for g in take(n, check=check)]
    try:
        assert isinstance(fleet, Fleet) and len({r.process.pid for r in fleet.replicas} | {os.getpid()}) == 3
        metrics, killed, lost_events = run_losing_replica_1(ctrl, STEPS, KILL_AT, kill_on_next_call)
        assert killed and fleet.lost == [1] and fleet.regenerated_groups >= killed[0] > 0
        assert len(lost_events) == 1 and lost_events[0] >= KILL_AT  # one health event, when it happened
        assert metrics["fleet/replicas_alive"] == 1 and metrics["fleet/replicas_lost"] == 1
        # no group lost, none trained twice: the trained ids are exactly the admission order
        assert trained == list(range(STEPS * 4)) and ctrl.staleness.released == 0
        assert (tmp_path / "logs" / "replica1.log").exists()
    finally:
        ctrl.close()
    assert not any(r.process.is_alive() for r in fleet.replicas)


@pytest.mark.slow
def test_a_killed_replica_is_restarted_within_max_restarts(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("quickstart", FAST + [f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path}",
                                            "runtime.max_restarts=1"])
    task = build_task(cfg.task, cfg.seed)
    model, tok = prepare_policy(cfg, task, torch.device("cpu"), announce=False)[:2]
    ctrl = build_async_controller(cfg, model, tok, length_reward, task.train_stream(0), log_dir=tmp_path / "logs")
    fleet, trained, killed = ctrl.backend, [], []
    take = ctrl.buffer.take
    ctrl.buffer.take = lambda n, check=None: [trained.append(g.admit_index) or g for g in take(n, check=check)]
    try:
        first_pid = fleet.replicas[1].process.pid
        for step in range(1, 4):
            if step == 2:
                killed = kill_on_next_call(fleet.replicas[1])
            metrics = ctrl.step(step)
            metrics.update(ctrl.weight_sync.wait())
            assert metrics["async/staleness_violations"] == 0
            assert fleet.version == step and fleet.replica_versions() == {0: step, 1: step}
        assert killed and fleet.lost == [] and fleet.replicas[1].restarts == 1
        assert fleet.replicas[1].process.pid != first_pid and fleet.replicas[1].is_alive()
        assert metrics["async/rollout_restarts"] == 1 and metrics["fleet/replicas_lost"] == 0
        assert trained == list(range(3 * 4)) and ctrl.staleness.released == 0
    finally:
        ctrl.close()
    assert not any(r.process.is_alive() for r in fleet.replicas)
