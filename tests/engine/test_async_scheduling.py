"""Overlapped scheduling (``EngineConfig.async_scheduling``): the host schedules step t+1
before reading step t's tokens. It must change nothing but speed: same tokens, log-probs,
finish reasons and versions as the step-by-step engine, under stop tokens, max_tokens,
chunked prefill, preemption and forks (CPU, fp32)."""
import pytest
from conftest import hf_greedy_loop, make_llm, prompts_for

from asyncrl.types import SamplingParams


def _run(path, overlap, prompts, params, **kw):
    llm = make_llm(path, async_scheduling=overlap, **kw)
    outs = llm.generate(prompts, params)
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
    return llm, [[(c.token_ids, c.finish_reason, c.versions) for c in o.completions] for o in outs], outs


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_blocks=14, max_num_batched_tokens=5)])
def test_overlapped_greedy_identical_and_matches_hf(kw, tiny_dirs, hf_models):
    """Greedy, EOS ignored; the second case preempts and chunks prefills."""
    prompts = prompts_for(2, [10, 12, 7, 15, 9, 11])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a_llm, a, _ = _run(tiny_dirs["qwen3"], False, prompts, params, **kw)
    b_llm, b, _ = _run(tiny_dirs["qwen3"], True, prompts, params, **kw)
    assert a == b
    if kw:
        assert b_llm.metrics["preemptions"] > 0
    for p, rows in zip(prompts, b):
        assert rows[0][0] == hf_greedy_loop(hf_models["qwen3"], p, 16)
    if not kw:  # max_tokens is known before the last token's id: no wasted step
        assert b_llm.num_steps == a_llm.num_steps  # (under preemption, admission lags a step)


def test_overlapped_stop_tokens_and_sampling_identical(tiny_dirs):
    """Seeded sampling with n=4 (forks), EOS on and a stop token: a sequence that stops is
    found one step late; its extra computed row must be discarded, not appended."""
    prompts = prompts_for(3, [5, 11, 8, 3])
    free = make_llm(tiny_dirs["llama"]).generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    stop = free[0].completions[0].token_ids[2]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=11, logprobs=True, stop_token_ids=[stop])
    _, a, outs_a = _run(tiny_dirs["llama"], False, prompts, params, num_kv_blocks=40)
    b_llm, b, outs_b = _run(tiny_dirs["llama"], True, prompts, params, num_kv_blocks=40)
    assert a == b
    reasons = {r for rows in b for _, r, _ in rows}
    assert "stop" in reasons and "length" in reasons  # both finish paths exercised
    for oa, ob in zip(outs_a, outs_b):
        for ca, cb in zip(oa.completions, ob.completions):
            # batches are composed differently (a late finish keeps a row one step longer):
            # fp32 results may differ in the last bits
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-5


def test_overlapped_abort_and_pause_drain(tiny_dirs):
    """abort/pause read the step in flight first: host state is complete when they return."""
    llm = make_llm(tiny_dirs["qwen3"], async_scheduling=True)
    prompt = prompts_for(10, [6])[0]
    rid = llm.add_request(prompt, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert llm._inflight is not None  # the third step's tokens are not read yet
    llm.pause()
    assert llm._inflight is None
    assert all(len(s.token_ids) - s.num_prompt_tokens == 3 for s in llm._requests[rid].group)
    llm.resume()
    llm.step()
    llm.abort([rid])
    res = llm._collect(rid)
    assert [len(c.token_ids) for c in res.completions] == [4] * 3
    assert not llm.has_unfinished()
    llm.block_manager.check_invariants([])


def test_step_returns_each_finish_once_when_read_outside_step(tiny_dirs):
    """A driver that waits on ``step()``'s finished list (asyncrl serve delivers outputs from it)
    must see the finishes a pause or weight update read from the step in flight: the next
    ``step`` returns them, each sequence exactly once, and ``has_unfinished`` stays true until then."""
    llm = make_llm(tiny_dirs["qwen3"], async_scheduling=True)
    rid = llm.add_request(prompts_for(11, [7])[0], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    seen = []
    while llm.has_unfinished():
        seen += llm.step()
        llm.pause()  # reads the step in flight: the finishes it observes wait for the next step
        llm.resume()
    assert sorted(s.sample_index for s in seen) == [0, 1, 2]
    assert llm.request_finished(rid) and llm.step() == []


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_overlapped_cuda_graphs_identical(tiny_dirs):
    """On the GPU path (CUDA graphs, pinned staging, pending ids gathered on the device):
    overlapped and step-by-step give the same tokens, with forks, a stop token, and a KV
    pool small enough to preempt."""
    import torch

    from asyncrl.engine import LLM

    prompts = prompts_for(30, [3, 17, 40, 9, 25, 33])
    kw = dict(dtype=torch.float32, device="cuda", compile_sampler=False, block_size=16, max_num_seqs=32,
              max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = LLM(tiny_dirs["qwen3"], async_scheduling=False, **kw).generate(prompts, greedy)
    stop = ref[0].completions[0].token_ids[5]
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=30, seed=2, stop_token_ids=[stop])
    for extra in (dict(), dict(num_kv_blocks=12)):
        out = {}
        for overlap in (False, True):
            llm = LLM(tiny_dirs["qwen3"], async_scheduling=overlap, **kw, **extra)
            assert llm.async_scheduling == overlap and llm.runner.graphs
            g = llm.generate(prompts, greedy)
            s = llm.generate(prompts, sampled)
            out[overlap] = ([c.token_ids for o in g for c in o.completions],
                            [(c.token_ids, c.finish_reason) for o in s for c in o.completions])
            assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
            if extra:
                assert llm.metrics["preemptions"] > 0
        assert out[False] == out[True]
        assert out[True][0] == [o.completions[0].token_ids for o in ref]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_sampling_decode_graphs_identical(tiny_dirs, overlap):
    """``decode_graph_sampler`` (the LM head and the one-pass sampler inside the decode graph) gives
    the tokens, finish reasons and log-probs of the sampler run after the graph: greedy and sampled
    rows, forks, a batch filling its bucket (16 greedy rows) and padded ones (12 sampled rows in the
    bucket of 16; smaller batches under preemption in a small pool); top-p rows take the plain graph."""
    import torch

    from asyncrl.engine import LLM

    kw = dict(dtype=torch.float32, device="cuda", compile_sampler=False, block_size=16, max_num_seqs=32,
              max_model_len=256, async_scheduling=overlap)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3, logprobs=True)
    top_p = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=12, seed=4, logprobs=True)
    cases = [(prompts_for(31, [5 + i for i in range(16)]), greedy), (prompts_for(32, [3, 17, 40]), sampled),
             (prompts_for(33, [7, 8, 9]), top_p)]
    out = {}
    for on in (False, True):
        for extra in (dict(), dict(num_kv_blocks=12)):
            llm = LLM(tiny_dirs["qwen3"], decode_graph_sampler=on, **kw, **extra)
            assert llm.runner.graph_sampler == on and (llm.runner.sampling_graphs[False] != {}) == on
            res = []
            for prompts, params in cases:
                outs = llm.generate(prompts, params)
                res.append([(c.token_ids, c.finish_reason, c.logprobs) for o in outs for c in o.completions])
            out[on, bool(extra)] = res
            assert (llm.runner.sampling_graph_steps > 0) == on
            if extra:
                assert llm.metrics["preemptions"] > 0
    for extra in (False, True):
        for ref, got in zip(out[False, extra], out[True, extra]):
            assert [(t, f) for t, f, _ in ref] == [(t, f) for t, f, _ in got]
            for (_, _, a), (_, _, b) in zip(ref, got):
                assert (a is None) == (b is None) and (a is None or max(abs(x - y) for x, y in zip(a, b)) < 1e-5)
