"""The critic: policy architecture + zero-initialised scalar head, values aligned with the
log-probs, and a clipped value loss that decreases when fitting a fixed batch."""
import torch

from asyncrl.config import load_config
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.critic import Critic, build_value_model, explained_variance
from asyncrl.types import TrainBatch


def _batch(tokenizer) -> TrainBatch:
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "123+456=", "7+7=", "9+1="]]
    responses = [[5, 6, tokenizer.eos_token_id], [7, 8, 9, 10], [tokenizer.eos_token_id], [11, 12]]
    ids, attn, mask, plen = pad_prompt_response(prompts, responses, tokenizer.pad_token_id)
    size, length = mask.shape
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                      rollout_logprobs=torch.zeros(size, length), token_versions=torch.zeros(size, length).long(),
                      scores=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]))


def _critic(model, **overrides):
    cfg = load_config(None, [f"critic.{k}={v}" for k, v in {"lr": 0.003, **overrides}.items()])
    return Critic(build_value_model(model), cfg.critic, "token-mean", micro_batch_size=3)


def test_value_model_copies_the_backbone_and_starts_at_zero(tiny_policy):
    model, tok = tiny_policy
    critic = _critic(model)
    batch = _batch(tok)
    values = critic.compute_values(batch)
    assert values.shape == batch.response_mask.shape
    assert torch.equal(values, torch.zeros_like(values))  # zero head: V = 0 before training
    backbone = critic.model.model.state_dict()
    for name, tensor in model.get_decoder().state_dict().items():
        assert torch.equal(backbone[name], tensor), name


def test_critic_loss_decreases_on_a_fixed_batch(tiny_policy):
    model, tok = tiny_policy
    critic = _critic(model, cliprange_value=10.0)
    batch = _batch(tok)
    batch.returns = batch.scores[:, None].expand_as(batch.response_mask) * batch.response_mask
    losses = []
    for _ in range(15):
        batch.values = critic.compute_values(batch)
        metrics = critic.update(batch)
        losses.append(metrics["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["critic/explained_variance"] > 0.0
    for key in ("critic/vf_clipfrac", "critic/vpred_mean", "critic/values_mean", "critic/grad_norm"):
        assert key in metrics


def test_micro_batching_does_not_change_the_critic_gradient(tiny_policy):
    model, tok = tiny_policy
    batch = _batch(tok)
    batch.values = torch.zeros_like(batch.response_mask)
    batch.returns = torch.rand_like(batch.response_mask) * batch.response_mask
    grads = []
    for micro in (1, 4):
        critic = _critic(model)
        critic.micro_batch_size = micro
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.model.score.weight, std=0.1)
        critic.update(batch)  # one optimizer step: .grad is the full mini-batch gradient
        grads.append(critic.model.score.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_explained_variance_hand_values():
    mask = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask) == 1.0           # perfect critic
    assert abs(explained_variance(torch.zeros(1, 4) + 2.5, returns, mask)) < 1e-6  # the mean: 0
    assert explained_variance(returns, torch.ones(1, 4), mask) == 0.0  # constant returns: reported as 0


def test_seq_mean_token_sum_norm_divides_by_the_loss_scale_factor(tiny_policy):
    """verl's critic inherits the actor's loss_scale_factor: with L_norm = 2x the padded length,
    the same batch's value loss halves (it was always divided by the padded length)."""
    model, tok = tiny_policy
    batch = _batch(tok)
    cfg = load_config(None, [])
    losses = []
    for factor in (None, 2.0 * batch.response_mask.shape[1]):
        critic = Critic(build_value_model(model), cfg.critic, "seq-mean-token-sum-norm", micro_batch_size=4,
                        loss_scale_factor=factor)
        batch.values = critic.compute_values(batch)
        batch.returns = torch.ones_like(batch.response_mask) * batch.response_mask
        losses.append(critic._optimizer_step(batch)["critic/vf_loss"])
    assert losses[1] == torch.tensor(losses[0] / 2).item()
