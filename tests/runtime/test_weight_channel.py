"""Weights to the rollout process by a torch.distributed broadcast
(``runtime.weight_transport=collective``; gloo on CPU, the NCCL path is the GPU test in
test_process_executor.py): the flat buffers alias their views, the weightless clone rebuilds
the module (ties kept), and the child's engine runs exactly the trainer's weights after each push."""
import json

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.data.tasks import build_task
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.executors.process import ProcessRolloutBackend
from asyncrl.runtime.executors.weight_channel import (FlatWeights, attach_weights, channel_backend,
                                                      weightless_clone)
from asyncrl.runtime.pipeline import prepare_policy, run_training
from asyncrl.runtime.weight_sync import LogprobProbe
from tests.runtime.child_exit import assert_stopped_cleanly

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "trainer.eval_samples=0"]
COLLECTIVE = ["runtime.mode=async", "runtime.max_staleness=1", "runtime.rollout_process=true",
              "runtime.weight_transport=collective", "algorithm.decoupled=true",
              "algorithm.rollout_correction.level=token"]


def policy(cfg):
    return prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)[:2]


def test_flat_weights_views_alias_one_buffer_per_dtype():
    named = [("a", torch.randn(2, 3)), ("b", torch.randn(4)), ("c", torch.randn(5).to(torch.bfloat16))]
    flat = FlatWeights(FlatWeights.specs_of(named), "cpu")
    assert {d: b.numel() for d, b in flat.buffers.items()} == {torch.float32: 10, torch.bfloat16: 5}
    flat.copy_from(named)
    assert all(torch.equal(flat.views[n], t) for n, t in named)
    flat.buffers[torch.float32].zero_()  # what a broadcast into the buffer does to the views
    assert not flat.views["a"].any() and not flat.views["b"].any() and flat.views["c"].any()


def test_a_weightless_clone_rebuilt_around_new_storage_is_the_same_model(cfg_of):
    model, _ = policy(cfg_of())
    skeleton = weightless_clone(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(not b.is_meta for b in skeleton.buffers())  # rotary inv_freq and friends survive
    flat = FlatWeights(FlatWeights.specs_of(skeleton.named_parameters()), "cpu")
    flat.copy_from(model.named_parameters())
    rebuilt = attach_weights(skeleton, flat.views, "cpu")
    assert rebuilt.lm_head.weight is rebuilt.model.embed_tokens.weight  # tied stays tied
    ids = torch.tensor([[1, 5, 7, 3, 4]])
    torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=0)
    flat.buffers[torch.float32].mul_(0)
    assert not rebuilt(ids).logits.any()  # the module reads the buffers, not a copy


def test_the_child_engine_runs_the_broadcast_weights():
    """Checked from the trainer's side: the child's engine samples, the trainer's own model
    recomputes the log-probs (so a broadcast that did not arrive cannot pass by comparing the
    child against its own stale copy)."""
    from asyncrl.config import load_config

    cfg = load_config("quickstart", FAST)
    model, tok = policy(cfg)
    backend = ProcessRolloutBackend(model, tok, "engine", transport="collective")
    probe = LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4)
    try:
        assert probe.check(backend, model, 0).gap < 1e-4  # the initial broadcast
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            backend.update_weights(model.named_parameters(), version)
            result = probe.check(backend, model, version)
            assert result.gap < 1e-4 and result.delta > 1e-3  # the weights moved, and the child followed
            assert backend.run_probe(probe, version).gap < 1e-4  # the child's own reference agrees
    finally:
        backend.close()
    assert_stopped_cleanly(backend)


def test_an_async_run_over_the_collective_transport(cfg_of, tmp_path):
    summary = run_training(cfg_of(*COLLECTIVE))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and all(r["async/staleness_violations"] == 0 for r in rows)
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in rows[1:])


def test_the_collective_transport_is_refused_where_it_cannot_work(cfg_of):
    with pytest.raises(ConfigError, match="runtime.rollout_process=true"):
        build_async_controller(cfg_of(*COLLECTIVE, "runtime.rollout_process=false"), None, None, None, iter(()))
    with pytest.raises(ValueError, match="same kind of device"):
        channel_backend(torch.device("cuda:0"), torch.device("cpu"))
    assert channel_backend(torch.device("cpu"), torch.device("cpu")) == "gloo"
