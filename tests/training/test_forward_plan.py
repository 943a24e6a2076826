"""One actor update in the fast plan (varlen layout, fused LM head with the entropy's gradient,
token-balanced micro-batches) equals the eager plan's (tree / padded layouts, plain head, rows
in order), loss and gradients to 1e-5 in fp32, for every loss aggregation mode."""
import copy

import pytest
import torch

import asyncrl.distributed.batches as batches_module
from asyncrl.algorithms.aggregation import LOSS_AGG_MODES
from asyncrl.config import load_config
from asyncrl.training import logprobs as lp_module
from asyncrl.training.actor import Actor
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.micro_batches import balanced_micro_batches
from asyncrl.types import TrainBatch


def _batch(tok) -> TrainBatch:
    """Three groups (3, 2 and 2 rows), responses of 0-7 tokens, advantages per row."""
    eos = tok.eos_token_id
    prompts = [tok(p)["input_ids"] for p in ["1+2="] * 3 + ["123+456="] * 2 + ["9+9="] * 2]
    responses = [[5, eos], [6, 7, 8, 9, 9, 9, eos], [], [9, 9, eos], [5, 6, 7, 8, 5], [8, eos], [7, 7, 7, eos]]
    ids, attn, mask, plen = pad_prompt_response(prompts, responses, tok.pad_token_id)
    size, length = mask.shape
    g = torch.Generator().manual_seed(0)
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                      rollout_logprobs=-torch.rand(size, length, generator=g) * mask,
                      token_versions=torch.zeros(size, length).long(), scores=torch.rand(size, generator=g),
                      group_ids=torch.tensor([0, 0, 0, 1, 1, 2, 2]),
                      advantages=torch.randn(size, 1, generator=g).expand(size, length) * mask,
                      ref_logprobs=-torch.rand(size, length, generator=g) * mask)


def _update(model, tok, mode: str, fast: bool, monkeypatch) -> tuple[dict, list[torch.Tensor]]:
    cfg = load_config(None, [f"algorithm.loss_agg_mode={mode}", "algorithm.entropy_coeff=0.01", "algorithm.kl_coef=0.1",
                             "actor.micro_batch_size=3", "actor.lr=1e-3",
                             f"actor.packing={'varlen' if fast else 'tree'}", "actor.kernels=eager"])
    actor = Actor(copy.deepcopy(model), cfg.actor, cfg.algorithm, temperature=0.9)
    with monkeypatch.context() as patch:
        if fast:
            patch.setattr(lp_module, "SMALL_LOGITS_BYTES", -1)  # the fused head even for a tiny vocabulary
        else:
            patch.setattr(batches_module, "balanced_micro_batches",  # micro-batches of 3 rows, not balanced
                          lambda mask, *_: list(torch.arange(mask.shape[0]).split(3)))
        metrics = actor.update(_batch(tok))
    return metrics, [p.grad.clone() for p in actor.model.parameters()]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fast_plan_update_equals_the_eager_plan(tiny_policy, mode, monkeypatch):
    model, tok = tiny_policy
    eager_metrics, eager_grads = _update(model, tok, mode, False, monkeypatch)
    fast_metrics, fast_grads = _update(model, tok, mode, True, monkeypatch)
    # the loss is the sum of the micro-batch losses, so equal gradients are equal losses; the
    # per-micro-batch metrics (pg_loss, entropy) are averaged by rows, so they depend on the split
    assert fast_metrics["actor/grad_norm"] == pytest.approx(eager_metrics["actor/grad_norm"], rel=1e-5)
    for fast, eager in zip(fast_grads, eager_grads):
        torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-4)
    assert fast_metrics["actor/tflops"] > 0


def test_micro_batches_keep_groups_whole_and_balance_tokens():
    """Groups of 10, 3, 3, 3 and 3 tokens into 2 micro-batches: the big group alone, the rest
    together (12 vs 10 tokens), not 4 rows / 4 rows in order."""
    lengths = [10, 3, 3, 3, 3]
    attn = torch.zeros(6, 12, dtype=torch.long)
    groups = torch.tensor([0, 1, 2, 3, 4, 4])  # the last group: 2 rows sharing a 1-token prompt
    for row, n in enumerate([10, 3, 3, 3, 2, 2]):
        attn[row, :n] = 1
    micro = balanced_micro_batches(attn, 1, groups, micro_batch_size=3)
    assert [m.tolist() for m in micro] == [[0], [1, 2, 3, 4, 5]]
    assert sum(lengths) == 22
