"""EAGLE speculation (spec/eagle.py, eagle_head.py) on a tiny Qwen3 target, CPU.

* The engine's drafts equal the training forward's (``EagleHead.unrolled``: pass j = draft j)
  on every round of a generation, through rejections: the head is trained on what it runs.
* Output with speculation equals output without it (greedy; sampled with argmax drafts), and a
  probabilistic head follows the target's exact law (TV over 8,192 samples, temperature, top-k,
  top-p), with a head trained briefly on the target's own samples (so drafts are often right).
* The checkpoint round-trips by path; bad heads and configs are refused by name.
"""
import pytest
import torch
from conftest import assert_same_completions, build_tiny, make_llm, prompts_for
from test_decoding import REPETITIVE, _tokens, assert_draft_follows_the_target_law, assert_greedy_rounds_skip_q

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.spec.eagle_head import load_head, new_head
from asyncrl.types import SamplingParams


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("eagle_target"))


@pytest.fixture(scope="module")
def hf(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def train_tiny_head(target_dir: str, out_dir: str) -> str:
    """A head trained for 60 steps on 64 of the target's own samples (what train-draft does)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.training.draft_head import DraftSample, train_head

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    outs = make_llm(target_dir).generate(prompts_for(11, [6] * 32), SamplingParams(
        n=2, temperature=0.8, max_tokens=16, seed=0, ignore_eos=True))
    samples = [DraftSample(o.prompt_token_ids + c.token_ids, 6) for o in outs for c in o.outputs]
    head = new_head(ModelConfig.from_dir(target_dir), seed=0)
    metrics = train_head(head, hf, samples, steps=60, batch_size=16, lr=3e-3, passes=3)
    assert metrics["agree_1"] > 0.5  # it learned the target's argmax on most positions
    head.save(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def trained_head(target, tmp_path_factory):
    return train_tiny_head(target, str(tmp_path_factory.mktemp("eagle_head")))


def _spec(path, **kw):
    return {"method": "eagle", "model": path, "num_speculative_tokens": 3, **kw}


def test_checkpoint_round_trips_with_hf_names(target, trained_head):
    head = load_head(trained_head)
    names = set(head.hf_state_dict())
    assert {"embed_norm.weight", "fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.up_proj.weight",
            "norm.weight"} <= names
    fresh = new_head(ModelConfig.from_dir(target))
    assert set(fresh.state_dict()) == set(head.state_dict())
    assert head.info["feature"] == "final_norm_hidden"


def test_heads_without_embed_norm_load_and_run_as_trained(target, tmp_path):
    """Checkpoints written before ``embed_norm`` (no flag in their ``eagle_head`` block) keep their
    forward: fc reads the raw embedding; new heads normalise it."""
    from asyncrl.engine.spec.eagle_head import CONFIG_KEY, EagleHead, head_config_dict

    raw = head_config_dict(ModelConfig.from_dir(target))
    assert raw[CONFIG_KEY]["embed_norm"] is True and new_head(ModelConfig.from_dir(target)).embed_norm is not None
    del raw[CONFIG_KEY]["embed_norm"]
    old = EagleHead(ModelConfig.from_dict(raw))
    old.save(str(tmp_path))
    head = load_head(str(tmp_path))
    assert head.embed_norm is None and "embed_norm.weight" not in head.hf_state_dict()
    e, f = torch.randn(3, head.config.hidden_size), torch.randn(3, head.config.hidden_size)
    assert torch.equal(head.fc_input(e, f), head.fc(torch.cat([e, f], -1)))
    make_llm(target, speculative_config=_spec(str(tmp_path))).generate(prompts_for(2, [5]), SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))


def test_engine_drafts_equal_the_training_forward(target, hf, trained_head):
    """Draft j of every round = argmax of the target head over ``unrolled`` pass j at that position."""
    llm = make_llm(target, num_kv_blocks=40, speculative_config=_spec(trained_head))
    proposer, rounds = llm.spec.proposer, []
    propose = proposer.propose

    def recording(batch, budgets):
        ids, counts, probs = propose(batch, budgets)
        rounds.extend((list(s.token_ids), d) for s, d in zip(batch.seqs, ids.tolist()))
        return ids, counts, probs

    proposer.propose = recording
    llm.generate(REPETITIVE[:2] + prompts_for(3, [6]), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    head = load_head(trained_head)
    assert len(rounds) > 10 and 0 < llm.metrics["spec_acceptance_rate"] < 1  # accepted and rejected drafts
    with torch.no_grad():
        for tokens, drafts in rounds:
            ids = torch.tensor([tokens + drafts])
            outs = head.unrolled(hf.get_input_embeddings()(ids), hf.model(input_ids=ids).last_hidden_state, 3)
            L = len(tokens)
            assert [int(hf.lm_head(outs[j][0, L - 1 + j]).argmax()) for j in range(3)] == drafts


def test_engine_acceptance_equals_the_offline_replay(target, hf, trained_head):
    """A trained head's acceptance in the engine = ``replay_acceptance`` (its training forward
    walked over the same greedy tokens): rounds, drafts and accepted drafts, exactly. What the
    training-side numbers promise is what the engine delivers; a drafting bug in the engine
    (features, shift, positions, the head's K/V) breaks the equality."""
    from asyncrl.training.draft_head import DraftSample
    from asyncrl.training.draft_replay import replay_acceptance

    # adaptive off: the replay walks rounds over every position, so every step must be a round
    llm = make_llm(target, speculative_config=dict(_spec(trained_head), adaptive=False))
    prompts = REPETITIVE[:2] + prompts_for(9, [6, 8, 5])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    samples = [DraftSample(o.prompt_token_ids + c.token_ids, len(o.prompt_token_ids)) for o in outs for c in o.outputs]
    replay = replay_acceptance(load_head(trained_head), hf, samples, k=3)
    m = llm.metrics
    assert (replay["rounds"], replay["drafted"], replay["accepted"]) == (
        m["spec_rows"], m["spec_draft_tokens"], m["spec_accepted_tokens"])
    assert m["spec_tokens_per_target_pass"] > 1.5, m  # the head drafts well: the equality is not 0 == 0


def test_same_tokens_and_logprobs_as_without_speculation(target, trained_head):
    prompts = REPETITIVE[:2] + prompts_for(3, [6])
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_k=20, max_tokens=24, seed=3, ignore_eos=True, n=2)):
        off = make_llm(target, num_kv_blocks=24).generate(prompts, params)
        # adaptive off: every step speculates (the bound on tokens per pass, preemption inside rounds)
        llm = make_llm(target, num_kv_blocks=24, speculative_config=_spec(trained_head, adaptive=False))
        on = llm.generate(prompts, params)
        assert _tokens(on) == _tokens(off)
        assert_same_completions(off, on, atol=1e-4)
        assert llm.metrics["spec_tokens_per_target_pass"] > 1.3
    assert llm.metrics["preemptions"] > 0  # the small pool preempted: features recomputed from the target


def test_trained_head_beats_an_untrained_one(target, trained_head, tmp_path):
    new_head(ModelConfig.from_dir(target), seed=1).save(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rates = {}
    for name, path in (("trained", trained_head), ("untrained", str(tmp_path))):
        llm = make_llm(target, speculative_config=_spec(path, adaptive=False))  # every position drafted
        llm.generate(prompts_for(21, [6] * 4), params)
        rates[name] = llm.metrics["spec_acceptance_rate"]
    assert rates["trained"] > rates["untrained"] + 0.2, rates


def test_probabilistic_head_follows_the_target_law(target, trained_head):
    assert_draft_follows_the_target_law(make_llm, target, trained_head, method="eagle")


def test_probabilistic_head_skips_q_on_greedy_rows(target, trained_head):
    assert_greedy_rounds_skip_q(target, _spec(trained_head))


def test_bad_heads_are_named(target, tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE head checkpoint"):
        make_llm(target, speculative_config=_spec(target))  # a plain model dir
    cfg = ModelConfig.from_dir(target)
    cfg.hidden_size = 32  # a head built for a narrower model
    new_head(cfg).save(str(tmp_path / "small"))
    with pytest.raises(ValueError, match="does not fit the target"):
        make_llm(target, speculative_config=_spec(str(tmp_path / "small")))
