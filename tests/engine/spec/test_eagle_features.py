"""EAGLE reads the target's features from the runner (``ModelRunner.features``: every cached
position's final hidden state at its KV slot, written by the target's own forward). Checked on CPU
against HF's hidden states for every feature a round reads: through forked samples (the copied
partial block), prefix-cache hits and decode steps the adaptive gate ran without speculation,
and no catch-up ever runs the target."""
import pytest
import torch
from conftest import make_llm, prompts_for
from test_adaptive import slow_speculation
from test_eagle import _spec, hf, target, trained_head  # noqa: F401 (fixtures)

from asyncrl.types import SamplingParams


def _watch_features(llm, hf, atol=1e-4):  # noqa: F811
    """Before every round, each row's recorded features (the runner's, by slot, positions
    0..L-2) against HF's last hidden state of its tokens; count the target forwards made inside
    a round. Returns {"rows": rows checked, "target_forwards": ...}."""
    proposer, runner, model = llm.spec.proposer, llm.runner, llm.runner.model
    seen = {"rows": 0, "target_forwards": 0, "in_round": False}
    forward, propose = model.forward, proposer.propose
    bsz = runner.block_size

    def check(seqs):
        with torch.no_grad():
            for s in seqs:
                n = len(s.token_ids) - 1  # cached positions 0..L-2
                pos = torch.arange(n)
                slots = torch.tensor(s.block_table)[pos // bsz] * bsz + pos % bsz
                ids = torch.tensor([s.token_ids[:n]], device=runner.device)
                ref = hf.model(input_ids=ids).last_hidden_state[0]
                torch.testing.assert_close(runner.features[slots.to(runner.device)], ref, atol=atol, rtol=atol)
                seen["rows"] += 1

    def counted(*a, **kw):
        seen["target_forwards"] += seen["in_round"]
        return forward(*a, **kw)

    def round_(batch, budgets):
        check(batch.seqs)
        seen["in_round"] = True
        try:
            return propose(batch, budgets)
        finally:
            seen["in_round"] = False

    model.forward, proposer.propose = counted, round_
    return seen


def test_features_equal_hf_through_forks_and_prefix_hits(target, hf, trained_head):  # noqa: F811
    llm = make_llm(target, speculative_config=dict(_spec(trained_head), adaptive=False))
    assert llm.runner.features is not None and llm.runner.model.feature_buffer is llm.runner.features
    seen = _watch_features(llm, hf)
    shared = prompts_for(5, [70])[0]  # > one 64-token block: the second prompt hits the prefix cache
    params = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=10, ignore_eos=True)
    llm.generate([shared + [7, 8], prompts_for(6, [5])[0]], params)
    hits = llm.metrics["prefix_cache_hit_tokens"]
    llm.generate([shared + [9]], params)  # its first block comes from the cache, features included
    assert llm.metrics["prefix_cache_hit_tokens"] - hits >= 64
    assert seen["rows"] >= 6 * 3 and seen["target_forwards"] == 0


def test_a_catch_up_after_plain_steps_reads_recorded_features(target, hf, trained_head):  # noqa: F811
    """The gate measures speculation slower, so most steps decode plain; each probe's catch-up
    (many positions) reads features the plain steps recorded: no target forward, right values."""
    llm = make_llm(target, speculative_config=_spec(trained_head))
    slow_speculation(llm, spec_cost=3.0)
    seen = _watch_features(llm, hf)
    llm.generate(prompts_for(4, [6, 9, 7]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    m = llm.metrics
    assert m["spec_gate_plain_steps"] > 0 and m["spec_catch_up_steps"] >= 1 and m["spec_catch_up_tokens"] > 0
    assert seen["rows"] > 0 and seen["target_forwards"] == 0


def test_the_feature_pool_is_counted_in_the_block_budget(target, trained_head):  # noqa: F811
    llm = make_llm(target, speculative_config=_spec(trained_head))
    proposer, runner = llm.spec.proposer, llm.runner
    c = proposer.head.config
    per_block = (2 * c.num_key_value_heads * c.head_dim + c.hidden_size) * runner.block_size * 4  # fp32
    assert proposer.block_bytes(runner.block_size) == per_block == runner.extra_block_bytes
    assert runner.features.shape == ((runner.num_blocks + 1) * runner.block_size, c.hidden_size)


def test_other_proposers_record_nothing(target):  # noqa: F811
    llm = make_llm(target, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.runner.features is None and llm.runner.model.feature_buffer is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_features_recorded_by_the_graphs(target, hf, trained_head):  # noqa: F811
    """On CUDA the decode graphs, the verify graph and the round graph write and read the features:
    equal to HF's (fp32) before every round, with the gate mixing plain and speculative steps."""
    from test_spec_gpu import cuda_llm

    llm = cuda_llm(target, speculative_config=_spec(trained_head))
    slow_speculation(llm, spec_cost=3.0)
    seen = _watch_features(llm, hf.to("cuda"), atol=2e-3)
    llm.generate(prompts_for(4, [6, 9, 7]) * 2, SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=60,
                                                                ignore_eos=True))
    m = llm.metrics
    assert seen["rows"] > 0 and seen["target_forwards"] == 0 and m["spec_gate_plain_steps"] > 0
    assert llm.spec.proposer.rounds["graph"] > 0
    hf.to("cpu")

