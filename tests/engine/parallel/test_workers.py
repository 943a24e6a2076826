"""``LLM(..., tensor_parallel_size=k)`` end to end on gloo: rank 0's scheduler drives spawned
worker ranks, and the engine returns the same greedy and seeded tokens (forks, top-p included)
with the same full-vocabulary log-probs as TP=1; weights loaded from an in-memory module and by
``update_weights`` reach every rank; a dead worker is named, and a bad size is refused before
anything is spawned."""
import os
import signal

import pytest
import torch

from asyncrl.engine.parallel import TensorParallelError
from asyncrl.engine.parallel.workers import TPWorkerError
from asyncrl.types import SamplingParams

from conftest import make_llm, prompts_for

PARAMS = [SamplingParams(n=2, temperature=0.0, max_tokens=8, logprobs=True, ignore_eos=True),
          SamplingParams(n=3, temperature=1.0, max_tokens=8, logprobs=True, seed=7, ignore_eos=True),
          SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_tokens=6, logprobs=True, seed=3)]


def outputs(llm, prompts):
    return [[(c.token_ids, c.logprobs, c.versions) for o in llm.generate(prompts, p) for c in o.completions]
            for p in PARAMS]


def assert_same(ours, ref):
    for got, want in zip(ours, ref):
        for (ids, lps, versions), (ids_1, lps_1, versions_1) in zip(got, want):
            assert ids == ids_1 and versions == versions_1
            assert max(abs(a - b) for a, b in zip(lps, lps_1)) <= 1e-5


@pytest.mark.slow
def test_tp2_engine_from_a_module_with_weight_updates(hf_models, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    hf, prompts = hf_models["qwen2"], prompts_for(1, [5, 9, 3])
    ref = make_llm(hf)
    tp = make_llm(hf, tensor_parallel_size=2)  # rank 0 broadcasts the module's tensors
    try:
        assert_same(outputs(tp, prompts), outputs(ref, prompts))
        before = outputs(tp, prompts)
        moved = {n: t + 0.05 * torch.randn_like(t) for n, t in hf.state_dict().items()}
        for llm in (ref, tp):
            llm.update_weights(moved.items(), version=1)
        after = outputs(tp, prompts)
        assert after != before and all(v == 1 for group in after for _, _, vs in group for v in vs)
        assert_same(after, outputs(ref, prompts))
        os.kill(tp.followers.processes[0].pid, signal.SIGKILL)
        tp.followers.processes[0].join(10)
        with pytest.raises(TPWorkerError, match="tensor-parallel worker 1 died"):
            tp.generate(prompts, PARAMS[0])
    finally:
        tp.close()
    assert not any(p.is_alive() for p in tp.followers.processes)


@pytest.mark.slow
def test_tp4_engine_with_replicated_kv_heads(tiny_dirs, monkeypatch):
    """Qwen3 with 2 KV heads over 4 ranks (each KV head on 2 ranks), from a checkpoint dir
    that every rank reads."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts = prompts_for(2, [7, 4, 12])
    ref = make_llm(tiny_dirs["qwen3"])
    tp = make_llm(tiny_dirs["qwen3"], tensor_parallel_size=4)
    try:
        assert [r.num_kv_heads for r in (ref.runner, tp.runner)] == [2, 1]
        assert_same(outputs(tp, prompts), outputs(ref, prompts))
    finally:
        tp.close()


def test_a_size_that_does_not_split_the_model_is_refused_before_spawning(tiny_dirs):
    with pytest.raises(TensorParallelError, match="valid sizes: 1, 2, 4$"):
        make_llm(tiny_dirs["llama"], tensor_parallel_size=3)


def test_speculative_decoding_with_tp_above_one_is_refused_before_spawning(tiny_dirs):
    """Speculation runs at tensor_parallel_size=1 only (its verify step drives rank 0 alone)."""
    import multiprocessing

    with pytest.raises(TensorParallelError, match="speculative decoding runs at tensor_parallel_size=1 only"):
        make_llm(tiny_dirs["llama"], tensor_parallel_size=2,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert multiprocessing.active_children() == []
