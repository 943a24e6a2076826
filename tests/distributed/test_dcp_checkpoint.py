"""Sharded (DCP) checkpoints: written by 2 ranks, resumed on 4 ranks and on one process, the next
step's loss and weights equal the uninterrupted 2-rank run's; the HF export loads with
``from_pretrained`` and holds the gathered weights; a checkpoint of another model shape is
refused naming the first tensor that differs."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from asyncrl.distributed import checkpoint as sharded
from asyncrl.distributed.group import SINGLE
from asyncrl.training.actor import Actor
from asyncrl.config import load_config
from tests.distributed import cases

TOL = 1e-6


def _same_next_step(resumed: dict, uninterrupted: dict):
    assert resumed["metrics"]["actor/pg_loss"] == pytest.approx(uninterrupted["metrics"]["actor/pg_loss"], abs=TOL)
    assert resumed["metrics"]["actor/grad_norm"] == pytest.approx(uninterrupted["metrics"]["actor/grad_norm"], rel=TOL)
    cases.assert_weights_close(resumed["weights"], uninterrupted["weights"], uninterrupted["grads"], "resumed weight")


def test_written_by_two_ranks_resumes_on_four(world2, world4):
    _same_next_step(world4["resume"], world2["checkpoint"])


def test_written_by_two_ranks_resumes_in_one_process(world2, checkpoint_dir):
    resumed = cases.resume_checkpoint(checkpoint_dir, sharded_run=False)
    _same_next_step(resumed, world2["checkpoint"])


def test_hf_export_loads_with_from_pretrained(world2, checkpoint_dir):
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    saved = world2["checkpoint"]["saved_weights"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name


def test_checkpoint_of_another_shape_is_refused_by_name(world2, checkpoint_dir):
    def model(intermediate: int, layers: int):
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=cases.VOCAB, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))

    cfg = load_config(None, [])
    actor = Actor(model(96, 2), cfg.actor, cfg.algorithm, 1.0)
    with pytest.raises(sharded.CheckpointMismatch, match=r"first mismatching tensor 'policy\.model\.layers\.0\.mlp"
                                                          r"\.\w+_proj\.weight' is \[\d+, \d+\] in the checkpoint"):
        sharded.load(checkpoint_dir, actor.forward_module, actor.optimizer, actor.scheduler, SINGLE)
    actor = Actor(model(64, 3), cfg.actor, cfg.algorithm, 1.0)
    with pytest.raises(sharded.CheckpointMismatch, match=r"'policy\.model\.layers\.2\..*' .* is not in it"):
        sharded.load(checkpoint_dir, actor.forward_module, actor.optimizer, actor.scheduler, SINGLE)
