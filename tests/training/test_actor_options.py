"""Actor options reach the loss: the off-policy weights multiply each token's loss, the
on-policy shortcut is off whenever something needs recomputed old log-probs, and entropy
is computed only when it is used or asked for."""
import copy
import math

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.training.actor import Actor
from asyncrl.training.batch import pad_prompt_response
from asyncrl.types import TrainBatch


def _actor(model, *overrides):
    cfg = load_config(None, list(overrides))
    return Actor(copy.deepcopy(model), cfg.actor, cfg.algorithm, temperature=1.0)


def _batch(tokenizer) -> TrainBatch:
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "123+456=", "7+7="]]
    responses = [[5, 6, tokenizer.eos_token_id], [7, 8, 9, 10], [tokenizer.eos_token_id]]
    ids, attn, mask, plen = pad_prompt_response(prompts, responses, tokenizer.pad_token_id)
    size, length = mask.shape
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                      rollout_logprobs=torch.zeros(size, length), token_versions=torch.zeros(size, length).long(),
                      scores=torch.tensor([1.0, 0.0, 1.0]), group_ids=torch.zeros(size, dtype=torch.long),
                      advantages=torch.tensor([[1.0], [-1.0], [0.5]]).expand(size, length) * mask)


@pytest.mark.parametrize("overrides, shortcut", [
    ([], True),
    (["actor.mini_batches=2"], False),
    (["algorithm.rollout_correction.level=token"], True),  # w = π_prox/π_behav from the update's forward
    (["algorithm.decoupled=true", "algorithm.rollout_correction.level=geometric"], True),
    (["algorithm.decoupled=true", "algorithm.rollout_correction.level=token", "actor.ppo_epochs=2"], False),
    (["algorithm.use_kl_in_reward=true"], False),
])
def test_on_policy_shortcut_is_off_when_old_logprobs_are_needed(tiny_policy, overrides, shortcut):
    assert _actor(tiny_policy[0], *overrides).on_policy_shortcut is shortcut


def _grads(actor, batch) -> list[torch.Tensor]:
    actor.model.train()
    actor.optimizer.zero_grad(set_to_none=True)
    mask = batch.response_mask
    metrics = actor._micro_loss(batch, float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    return [p.grad.clone() for p in actor.model.parameters() if p.grad is not None], metrics


def test_is_weights_multiply_each_tokens_loss(tiny_policy):
    model, tok = tiny_policy
    batch = _batch(tok)
    batch.old_logprobs = _actor(model).compute_logprobs(batch)  # ratio 1: no clipping anywhere
    weights = torch.tensor([[0.5, 1.5, 1.0, 1.0], [1.0, 0.25, 1.0, 1.0], [1.8, 1.0, 1.0, 1.0]]) * batch.response_mask
    batch.rollout_logprobs = batch.old_logprobs - torch.log(weights.clamp(min=1e-6)) * batch.response_mask
    corrected, metrics = _grads(_actor(model, "algorithm.rollout_correction.level=token"), batch)
    # the same update without correction but with w folded into the advantage: −A·w·∇lp
    plain_batch = copy.copy(batch)
    plain_batch.advantages = batch.advantages * weights
    plain, _ = _grads(_actor(model), plain_batch)
    for a, b in zip(corrected, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert metrics["rollout_correction/is_weight_mean"] == pytest.approx(float(weights.sum() / batch.response_mask.sum()), rel=1e-4)


def test_truncation_caps_the_weight_at_the_threshold(tiny_policy):
    model, tok = tiny_policy
    batch = _batch(tok)
    batch.old_logprobs = _actor(model).compute_logprobs(batch)
    batch.rollout_logprobs = (batch.old_logprobs - math.log(10.0)) * batch.response_mask  # w = 10 everywhere
    capped, metrics = _grads(_actor(model, "algorithm.rollout_correction.level=token",
                                    "algorithm.rollout_correction.threshold=2.0"), batch)
    doubled = copy.copy(batch)
    doubled.advantages = batch.advantages * 2.0
    plain, _ = _grads(_actor(model), doubled)
    for a, b in zip(capped, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert metrics["rollout_correction/is_clipped_frac"] == 1.0


def test_entropy_only_when_used_or_asked(tiny_policy):
    model, tok = tiny_policy
    batch = _batch(tok)
    _, with_entropy = _grads(_actor(model), batch)
    _, without = _grads(_actor(model, "algorithm.calculate_entropy=false"), batch)
    _, bonus = _grads(_actor(model, "algorithm.calculate_entropy=false", "algorithm.entropy_coeff=0.01"), batch)
    assert "actor/entropy" in with_entropy and "actor/entropy" not in without and "actor/entropy" in bonus


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_decoupled_shortcut_equals_the_recomputed_proximal_logprobs(tiny_policy, level):
    """One optimizer step: decoupled PPO with π_prox taken from the update's own forward gives
    the gradients and correction metrics of the separate π_prox recompute, for a stale
    behaviour policy (rollout log-probs far from the trainer's)."""
    model, tok = tiny_policy
    overrides = ("algorithm.decoupled=true", f"algorithm.rollout_correction.level={level}")
    batch = _batch(tok)
    recompute = _actor(model, *overrides)
    assert recompute.on_policy_shortcut
    prox = recompute.compute_logprobs(batch)
    noise = torch.tensor([[0.3, -0.4, 0.2, 0.1], [-0.2, 0.5, -0.1, 0.3], [0.6, 0.0, 0.0, 0.0]])
    batch.rollout_logprobs = (prox + noise) * batch.response_mask  # a stale π_behav
    batch.old_logprobs = prox
    expected, m_expected = _grads(recompute, batch)
    shortcut = copy.copy(batch)
    shortcut.old_logprobs = None
    got, m_got = _grads(_actor(model, *overrides), shortcut)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for key in ("rollout_correction/is_weight_mean", "rollout_correction/mismatch_k1", "actor/pg_loss"):
        assert m_got[key] == pytest.approx(m_expected[key], rel=1e-4, abs=1e-6), key


def test_an_infinite_loss_skips_the_step_though_its_gradients_are_finite(tiny_policy, monkeypatch):
    """Backward runs without a host read of the loss; its device flag alone skips the step."""
    import asyncrl.training.actor as actor_module

    model, tok = tiny_policy
    actor = _actor(model, "actor.micro_batch_size=1")
    real, calls = actor_module.compute_policy_loss, []

    def infinite_second(name, inp, cfg):
        out = real(name, inp, cfg)
        calls.append(name)
        if len(calls) == 2:
            out.loss = out.loss + math.inf  # a constant: the gradients stay finite
        return out

    batch = _batch(tok)
    batch.group_ids = torch.arange(3)  # one group per row: three micro-batches of one row
    before = [p.detach().clone() for p in actor.model.parameters()]
    monkeypatch.setattr(actor_module, "compute_policy_loss", infinite_second)
    metrics = actor.update(batch)
    assert len(calls) == 3
    assert metrics["actor/skipped_step"] == 1.0 and math.isfinite(metrics["actor/grad_norm"])
    assert metrics["actor/nonfinite_loss"] == pytest.approx(1 / 3)  # one micro-batch of one row out of 3
    assert math.isfinite(metrics["actor/pg_loss"]) and "actor/_nonfinite_micros" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters()))
    monkeypatch.setattr(actor_module, "compute_policy_loss", real)
    metrics = actor.update(batch)
    assert metrics["actor/skipped_step"] == 0.0 and "actor/nonfinite_loss" not in metrics
    assert not all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters()))


def test_update_runs_in_training_mode_after_an_eval_forward(tiny_policy):
    """compute_logprobs puts the modules in eval mode; the update (which skips train() when every
    module is already training) must switch every one of them back."""
    model, tok = tiny_policy
    actor, batch = _actor(model), _batch(tok)
    seen = []
    hook = lambda module, args: seen.append(module.training)  # noqa: E731
    handles = [m.register_forward_pre_hook(hook) for m in actor.model.modules()]
    actor.compute_logprobs(batch)
    assert seen and not any(seen)
    seen.clear()
    actor.update(batch)
    assert seen and all(seen)
    submodule = next(m for m in actor.model.modules() if m is not actor.model)
    submodule.eval()  # one module out of training mode is enough to need train()
    seen.clear()
    actor.update(batch)
    assert all(seen) and submodule.training
    for handle in handles:
        handle.remove()
