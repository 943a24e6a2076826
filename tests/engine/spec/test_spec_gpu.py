"""Speculative decoding on a GPU: the paged multi-query verify kernel, the verify and draft CUDA
graphs. Same checks as test_decoding.py (token identity with speculation off, the target's law
over 8,192 samples), on CUDA in float32 (IEEE paths: no tf32 rounding, so argmax ties cannot
differ between the decode and the verify kernels). Skipped without CUDA."""
import pytest
import torch
from conftest import assert_same_completions, prompts_for
from test_decoding import REPETITIVE, _tokens, assert_draft_follows_the_target_law, perturbed_draft, target  # noqa: F401

from asyncrl.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_llm(path, **kw):
    from asyncrl.engine import LLM

    return LLM(path, dtype=torch.float32, device="cuda", block_size=16, max_model_len=256,
               gpu_memory_utilization=0.3, **kw)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_gpu_same_tokens_as_without_speculation(target, perturbed_draft, method):  # noqa: F811
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False} | (
        {"model": perturbed_draft} if method != "ngram" else {})
    prompts = REPETITIVE + prompts_for(5, [6, 9, 17])
    # greedy and unfiltered sampling verify inside the bucket's graph (sampler + verifier captured);
    # top-k runs the sampler and verifier eagerly on the graph's logits
    cases = ((dict(temperature=0), "graph_tail"), (dict(temperature=1.0, seed=4, n=2), "graph_tail"),
             (dict(temperature=1.0, top_k=20, seed=3, n=2), "graph"))
    for kw, path in cases:
        params = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
        off = cuda_llm(target).generate(prompts, params)
        llm = cuda_llm(target, speculative_config=spec)
        on = llm.generate(prompts, params)
        assert _tokens(on) == _tokens(off)
        assert_same_completions(off, on, atol=1e-3)
        assert llm.metrics["spec_accepted_tokens"] > 0
        assert llm.spec.verify_step.rounds[path] > 0, llm.spec.verify_step.rounds


def test_gpu_probabilistic_draft_model_on_greedy_rows_verifies_in_the_graph(target, perturbed_draft):  # noqa: F811
    """Issue 23: greedy rows of a probabilistic draft model draft through the argmax round graph and
    verify inside the bucket's graph (no q: ``graph_tail``), with the tokens of speculation off."""
    spec = {"method": "draft_model", "model": perturbed_draft, "num_speculative_tokens": 3,
            "draft_sampling": "probabilistic", "adaptive": False}
    prompts = REPETITIVE + prompts_for(5, [6, 9, 17])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = cuda_llm(target, speculative_config=spec)
    assert _tokens(llm.generate(prompts, params)) == _tokens(cuda_llm(target).generate(prompts, params))
    assert llm.spec.proposer.graphs and llm.spec.proposer.prob_graphs
    rounds = llm.spec.verify_step.rounds
    assert rounds["graph_tail"] > 0 and rounds["graph"] == 0, rounds


def test_gpu_probabilistic_draft_follows_the_target_law(target, perturbed_draft):  # noqa: F811
    assert_draft_follows_the_target_law(cuda_llm, target, perturbed_draft)



def test_gpu_eagle_same_tokens_and_the_target_law(tmp_path):
    """EAGLE on CUDA: the round graph (catch-up padded to k + 1 entries on the paged kernel from the
    verify graph's features, then the draft steps) and the eager first rounds; greedy and sampled equal speculation
    off, and a probabilistic head follows the target's law. The head is trained on the CPU."""
    from conftest import build_tiny
    from test_eagle import _spec, train_tiny_head

    target_dir = build_tiny("qwen3", tmp_path / "target")
    head = train_tiny_head(target_dir, str(tmp_path / "head"))
    prompts = REPETITIVE + prompts_for(5, [6, 9, 17])
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_k=20, max_tokens=40, seed=3, ignore_eos=True, n=2)):
        off = cuda_llm(target_dir).generate(prompts, params)
        llm = cuda_llm(target_dir, speculative_config=_spec(head, adaptive=False))
        on = llm.generate(prompts, params)
        assert _tokens(on) == _tokens(off)
        assert llm.metrics["spec_tokens_per_target_pass"] > 1.3
        rounds = llm.spec.proposer.rounds  # the captured round graph ran (first rounds: eager)
        assert rounds["graph"] > rounds["eager"] > 0
    # every draft of the captured round graphs equals the eager rounds' (catch-up: paged kernel vs gathered SDPA, fp32)
    import asyncrl.engine.spec.eagle as eagle
    from test_eagle_paged import _drafts

    seen = {}
    for graphs in (True, False):
        eagle.GRAPHS = graphs
        try:
            seen[graphs] = _drafts(cuda_llm(target_dir, speculative_config=_spec(head, adaptive=False)))
        finally:
            eagle.GRAPHS = True
    assert seen[True] == seen[False]
    assert_draft_follows_the_target_law(cuda_llm, target_dir, head, method="eagle")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_gpu_adaptive_gate_mixes_steps_exactly(target, perturbed_draft, method):  # noqa: F811
    """The speed gate on CUDA (overlapped plain steps, graphs): verify passes made slow on a fake
    clock, so speculative and plain steps alternate; tokens and log-probs equal speculation off's."""
    from test_adaptive import slow_speculation

    spec = {"method": method, "num_speculative_tokens": 3} | ({"model": perturbed_draft} if method != "ngram" else {})
    prompts = REPETITIVE + prompts_for(5, [6, 9, 17])
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True),
                   SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40, ignore_eos=True, logprobs=True)):
        off = cuda_llm(target).generate(prompts, params)
        llm = cuda_llm(target, speculative_config=spec)
        assert llm.async_scheduling
        slow_speculation(llm, spec_cost=40.0)
        on = llm.generate(prompts, params)
        assert _tokens(on) == _tokens(off)
        assert_same_completions(off, on, atol=1e-3)
        m = llm.metrics
        assert m["spec_steps"] > 0 and m["spec_gate_plain_steps"] > 0 and m["spec_gate_probes"] >= 2
