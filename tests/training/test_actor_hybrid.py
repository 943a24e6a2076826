"""GRPO on Qwen3.5's hybrid architecture trains (the CPU regression guard of issue 22's learning
run, bench/RESULTS.md): a few actor updates on a tiny ``Qwen3_5ForCausalLM`` (3 Gated DeltaNet +
1 gated-attention layer) raise the log-prob of every rewarded completion, lower the others' on
average, and
move every Gated DeltaNet weight. tests/training/test_gdn_cpu.py checks the same forward and
gradients against transformers' own torch path."""
import torch

from asyncrl.config import TinyModelConfig, load_config
from asyncrl.data.char_tokenizer import build_char_tokenizer
from asyncrl.training.actor import Actor
from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.model import build_tiny_model
from asyncrl.types import TrainBatch


def _group_advantages(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """GRPO's (r - mean) / std within each group of equal size."""
    by_group = scores.view(groups, -1)
    return ((by_group - by_group.mean(-1, keepdim=True)) / (by_group.std(-1, keepdim=True) + 1e-6)).view(-1)


def _batch(tok) -> TrainBatch:
    """2 prompts x 4 responses; the responses that start with the right digit are rewarded."""
    prompts = [tok(p)["input_ids"] for p in ["12+3=", "4+56="]]
    answers = [["15", "16", "25", "9"], ["60", "61", "6", "50"]]
    right = [["15", "16"], ["60", "61"]]
    rows = [(p, tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], a in good)
            for p, group, good in zip(prompts, answers, right) for a in group]
    ids, attn, mask, plen = pad_prompt_response([r[0] for r in rows], [r[1] for r in rows], tok.pad_token_id)
    scores = torch.tensor([float(r[2]) for r in rows])
    size, length = mask.shape
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                      rollout_logprobs=torch.zeros(size, length), token_versions=torch.zeros(size, length).long(),
                      scores=scores, group_ids=torch.arange(2).repeat_interleave(4),
                      advantages=_group_advantages(scores, 2)[:, None] * mask)


def _sequence_logprobs(actor, batch) -> torch.Tensor:
    with torch.no_grad():
        return (actor.compute_logprobs(batch) * batch.response_mask).sum(-1)


def test_grpo_updates_raise_the_rewarded_completions_of_a_hybrid_model():
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(architecture="qwen3_5", hidden_size=32, head_dim=8,
                                             intermediate_size=64), tok, seed=0)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    cfg = load_config(None, ["actor.lr=3e-3"])
    actor = Actor(model, cfg.actor, cfg.algorithm, temperature=1.0)
    batch = _batch(tok)
    gdn_before = {n: p.detach().clone() for n, p in model.named_parameters() if "linear_attn" in n}
    before = _sequence_logprobs(actor, batch)
    for _ in range(4):
        batch.rollout_logprobs = actor.compute_logprobs(batch)  # on-policy rollouts of the current weights
        metrics = actor.update(batch)
        assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    gain = _sequence_logprobs(actor, batch) - before
    rewarded = batch.scores.bool()
    assert float(gain[rewarded].min()) > 0.5, gain  # each rewarded answer (1.7-2.2 nats here)
    assert float(gain[~rewarded].mean()) < -0.5, gain  # "6" shares its first token with "60"/"61": the mean falls
    moved = [n for n, p in model.named_parameters() if n in gdn_before and not torch.equal(p, gdn_before[n])]
    assert sorted(moved) == sorted(gdn_before), set(gdn_before) - set(moved)  # conv, A_log, dt_bias, norms too
