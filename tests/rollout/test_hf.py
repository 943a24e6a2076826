"""HF-generate backend: shapes, finish reasons, versions, and behaviour log-probs."""
import torch

from asyncrl.rollout.base import RolloutBackend
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.training.batch import build_train_batch
from asyncrl.training.logprobs import response_logprobs
from asyncrl.types import SamplingParams


def test_generate_returns_n_completions_with_consistent_fields(tiny_policy):
    model, tok = tiny_policy
    backend = HFGenerateBackend(model, tok, version=3)
    assert isinstance(backend, RolloutBackend)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "45+67="]]
    outs = backend.generate(prompts, SamplingParams(n=4, max_tokens=5, seed=0))
    assert len(outs) == 2 and all(len(o.completions) == 4 for o in outs)
    for out in outs:
        for c in out.completions:
            assert 1 <= len(c.token_ids) <= 5
            assert len(c.logprobs) == len(c.token_ids) == len(c.versions)
            assert set(c.versions) == {3}
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)
            assert all(lp <= 0 for lp in c.logprobs)


def test_behaviour_logprobs_match_the_trainer(tiny_policy):
    """Sampled-token log-probs from generate equal the trainer's recomputation."""
    model, tok = tiny_policy
    backend = HFGenerateBackend(model, tok)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+4=", "9+9="]]
    for temperature in (1.0, 0.6):
        outs = backend.generate(prompts, SamplingParams(n=3, max_tokens=6, temperature=temperature, seed=1))
        batch = build_train_batch(outs, [0.0] * 9, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length, temperature)
        torch.testing.assert_close(lp * batch.response_mask, batch.rollout_logprobs, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(tiny_policy):
    model, tok = tiny_policy
    backend = HFGenerateBackend(model, tok)
    prompts = [tok("12+34=")["input_ids"]]
    a = backend.generate(prompts, SamplingParams(n=4, max_tokens=6, seed=7))
    b = backend.generate(prompts, SamplingParams(n=4, max_tokens=6, seed=7))
    assert [c.token_ids for c in a[0].completions] == [c.token_ids for c in b[0].completions]
    g = backend.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=0.0))
    assert g[0].completions[0].token_ids == g[0].completions[1].token_ids


def test_update_weights_copies_tensors_and_sets_version(tiny_policy, tiny_checkpoint):
    from asyncrl.training.model import load_policy
    model, tok = tiny_policy
    other, _ = load_policy(tiny_checkpoint)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    backend = HFGenerateBackend(model, tok)
    backend.update_weights(other.named_parameters(), version=5)
    assert backend.version == 5
    for (_, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b)
