"""A fleet of engine replicas as Ray actors (``runtime.executor=ray``, local Ray): two replicas
serve one async run of the quickstart with 0 staleness violations and the same version on
every replica after every sync (probed on each); one replica actor is killed mid-run twice:
first it is replaced (``runtime.max_restarts=1``: a new actor from the last pushed weights),
then it is lost: its groups are generated again on the other, no group is lost or trained
twice, and the ``replica_lost`` health event fires. Bad input: more replicas x TP than the Ray cluster's GPUs
is refused before any model loads; a replica actor that never becomes ready is named, with its
log, within the timeout."""
import os
import re
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from asyncrl import cli  # noqa: E402
from asyncrl.config import load_config  # noqa: E402
from asyncrl.data.tasks import build_task  # noqa: E402
from asyncrl.rollout.fleet import Fleet  # noqa: E402
from asyncrl.runtime.async_controller import build_async_controller  # noqa: E402
from asyncrl.runtime.executors.process import RolloutProcessError  # noqa: E402
from asyncrl.runtime.executors.ray_replicas import RayReplica, start_ray_fleet  # noqa: E402
from asyncrl.runtime.pipeline import prepare_policy  # noqa: E402
from tests.rollout.test_fleet import run_restarting_then_losing_replica_1  # noqa: E402

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.prompts_per_step=4",
        "rollout.n=4", "task.num_eval=16", "logging.progress=false", "logging.tensorboard=false",
        "runtime.mode=async", "runtime.max_staleness=1", "algorithm.decoupled=true",
        "algorithm.rollout_correction.level=token", "runtime.executor=ray", "rollout.engines=2",
        "runtime.rollout_workers=2", "runtime.reward_workers=1"]
STEPS, RESTART_AT, KILL_AT = 5, 2, 4  # runtime.max_restarts=1: the first kill is restarted, the second lost


def kill_on_next_call(replica: RayReplica) -> list:
    """The replica's actor is killed when the fleet next sends it groups (in flight on it then)."""
    generate, killed = replica.generate, []

    def die_then_generate(prompts, params):
        if not killed:
            killed.append(len(prompts))
            ray.kill(replica.actor, no_restart=True)
        return generate(prompts, params)
    replica.generate = die_then_generate
    return killed


@pytest.mark.ray
def test_two_ray_replicas_serve_an_async_run_and_survive_losing_one(local_ray, tmp_path):
    cfg = load_config("quickstart", FAST + [f"logging.run_dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path}",
                                            "runtime.max_restarts=1"])
    task = build_task(cfg.task, cfg.seed)
    model, tok = prepare_policy(cfg, task, torch.device("cpu"), announce=False)[:2]
    ctrl = build_async_controller(cfg, model, tok, task.reward, task.train_stream(0), log_dir=tmp_path / "logs")
    fleet, trained = ctrl.backend, []
    take = ctrl.buffer.take
    ctrl.buffer.take = lambda n, check=None: [trained.append(g.admit_index) or g for g in take(n, check=check)]
    try:
        assert isinstance(fleet, Fleet) and all(isinstance(r, RayReplica) for r in fleet.replicas)
        pids = {ray.get(r.actor.where.remote())[1] for r in fleet.replicas}
        assert len(pids) == 2 and not pids & {os.getpid()}  # two actor processes
        first_actor = fleet.replicas[1].actor
        metrics, killed, lost_events = run_restarting_then_losing_replica_1(
            ctrl, STEPS, RESTART_AT, KILL_AT, kill_on_next_call, lambda: fleet.replicas[1].actor is not first_actor)
        assert killed and fleet.lost == [1] and fleet.regenerated_groups >= killed[0] > 0
        assert len(lost_events) == 1 and lost_events[0] >= KILL_AT
        assert metrics["fleet/replicas_alive"] == 1 and metrics["fleet/replicas_lost"] == 1
        # no group lost, none trained twice: the trained ids are exactly the admission order
        assert trained == list(range(STEPS * 4)) and ctrl.staleness.released == 0
        assert (tmp_path / "logs" / "replica0.log").exists()  # the actors' output (local Ray: this node)
    finally:
        ctrl.close()
    from ray.util.placement_group import placement_group_table
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


@pytest.mark.ray
def test_more_replicas_times_tp_than_the_clusters_gpus_fails_before_any_model_loads(local_ray, capsys):
    assert ray.cluster_resources().get("GPU") == 2  # the fixture's (logical) GPUs
    args = ["train", "quickstart", "runtime.mode=async", "algorithm.decoupled=true",
            "algorithm.rollout_correction.level=token", "runtime.executor=ray", "rollout.engines=2",
            "rollout.tensor_parallel_size=2", "runtime.rollout_device=cuda", "sft.cache_dir=/nonexistent/never"]
    assert cli.main(args) == 2
    assert re.search(r"config error: rollout.engines=2 x rollout.tensor_parallel_size=2 needs 4 GPU\(s\), but the "
                     r"Ray cluster has 2", capsys.readouterr().err)


class HangOnLoad:
    """Unpickling it never returns: a replica stuck while starting (an import, a lock, a driver)."""

    def __reduce__(self):
        return time.sleep, (3600,)


@pytest.mark.ray
def test_a_replica_actor_that_never_becomes_ready_is_named_with_its_log(local_ray, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=4, intermediate_size=32))
    started = time.monotonic()
    with pytest.raises(RolloutProcessError, match=r"rollout replica 0 \(Ray actor on node [\d.]+\) did not become "
                                                  r"ready within 4s; its log: .*replica0\.log on node [\d.]+$"):
        start_ray_fleet(model, HangOnLoad(), "engine", engines=1, tensor_parallel_size=1, on_gpu=False,
                        log_dir=tmp_path, start_timeout_s=4)
    assert time.monotonic() - started < 30
    from ray.util.placement_group import placement_group_table
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())  # actor and bundle released


def test_weights_cross_the_object_store_as_arrays_bit_for_bit():
    from asyncrl.runtime.executors.ray_replicas import from_array, to_array

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tensor = (torch.randn(3, 5) * 100).to(dtype)
        array, name = to_array(tensor)
        back = from_array(array, name)
        assert back.dtype == dtype and torch.equal(back, tensor)
