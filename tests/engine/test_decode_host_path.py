"""The CUDA decode path's host logic, run on CPU through the Triton interpreter: an engine whose runner
is switched onto that path after its build (``is_cuda``, a ``CascadeBuffers``) builds paged-decode
arrays and cascade plans (reused between steps), gathers its pending ids from the last step's samples,
and runs the paged / cascade Triton kernels; its tokens and log-probs equal the gathered CPU path's."""
import os

import pytest
from conftest import make_llm, prompts_for

from asyncrl.engine.cascade import CascadeBuffers
from asyncrl.types import SamplingParams

if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU runs this path for real (test_gpu.py, test_async_scheduling.py)
    pytest.skip("the CPU's run of the GPU path: needs TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401 (autouse: numpy 2 in the interpreter)


def _on_the_gpu_host_path(llm):
    r = llm.runner
    r.cascade = CascadeBuffers(r.num_heads, r.num_kv_heads, r.block_size, llm.config.max_num_seqs, r.device)
    r.is_cuda = True  # prepare: paged inputs + cascade plan; forward: the paged kernels (no graphs on CPU)
    return llm


def test_paged_host_path_equals_gathered_path(tiny_dirs):
    prompts = prompts_for(5, [9, 13, 6])
    runs = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1, logprobs=True, ignore_eos=True)]
    ref = make_llm(tiny_dirs["qwen3"], async_scheduling=True)
    paged = _on_the_gpu_host_path(make_llm(tiny_dirs["qwen3"], async_scheduling=True))
    for params in runs:
        want, got = ref.generate(prompts, params), paged.generate(prompts, params)
        for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
            assert a.token_ids == b.token_ids
            if a.logprobs is not None:
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    cascade = paged.runner.cascade
    assert cascade.steps > 0 and 0 < cascade.plans_reused < cascade.steps


class _Replay:
    """Stands in for a captured CUDA graph on the CPU: ``replay`` runs the captured step eagerly on
    the same static buffers (what a real replay computes)."""

    def __init__(self, step, bs: int):
        self.step, self.bs = step, bs

    def replay(self) -> None:
        self.step(self.bs)


def _graphed(llm, monkeypatch, sampler: bool, graph_sampler: bool = False):
    """The GPU host path with its graph buckets (padding rows, graph buffers, per-bucket views);
    ``sampler``: the one-pass Triton sampler; ``graph_sampler``: also the decode graphs that sample
    (``EngineConfig.decode_graph_sampler``, which the CPU engine's build leaves off)."""
    from asyncrl.engine import model_runner

    _on_the_gpu_host_path(llm)
    r = llm.runner
    if sampler:
        from asyncrl.engine.triton_sampler import sample_unfiltered

        r.sampler.fast = sample_unfiltered
    r.graph_sampler = graph_sampler
    monkeypatch.setattr(model_runner, "capture_graphs",
                        lambda sizes, *steps, **_: [{bs: _Replay(step, bs) for bs in sizes} for step in steps])
    monkeypatch.setattr(model_runner, "current_capture_stream", lambda: None)
    r._capture_cudagraphs()
    return llm


def test_longest_first_programs_give_the_gathered_paths_tokens(tiny_dirs, monkeypatch):
    """The engine's decode launch dispatches the longest sequences first (``DecodeLaunch.longest_first``, on
    by default): the host sorts the rows with the step's inputs (``AttentionMetadata.longest_first``; no device
    sort), in ``longest_first_order``'s order, every layer's kernel reads it, and the tokens and log-probs equal
    the gathered path's."""
    from asyncrl.engine import attention
    from asyncrl.engine import triton_decode as td

    monkeypatch.setattr(td, "_LAUNCH_PINNED", False)  # the default rule even where the environment pins one
    monkeypatch.setattr(td, "DECODE_LAUNCH", td.DecodeLaunch())
    device_sorts, orders = [], []
    made = td.longest_first_order
    monkeypatch.setattr(td, "longest_first_order", lambda lens: device_sorts.append(lens.shape[0]) or made(lens))
    read = attention.AttentionMetadata.decode_order

    def spy(meta):
        orders.append((read(meta).clone(), made(meta.context_lens)))
        return orders[-1][0]

    monkeypatch.setattr(attention.AttentionMetadata, "decode_order", spy)
    prompts = prompts_for(5, [9, 13, 6])
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, logprobs=True, ignore_eos=True)
    want = make_llm(tiny_dirs["qwen3"], async_scheduling=True).generate(prompts, params)
    got = _on_the_gpu_host_path(make_llm(tiny_dirs["qwen3"], async_scheduling=True)).generate(prompts, params)
    for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert device_sorts == []
    # every layer of the 7 decode steps after the prefill read the host's order, which is the device sort's
    assert len(orders) == 7 * 2 and all(host.tolist() == device.tolist() for host, device in orders)


def test_host_order_is_the_device_sorts_order_with_ties_and_padding():
    """``_decode_paged_inputs``' order: ``longest_first_order``'s (descending, ties in row order), padding rows
    (context 1) included."""
    import types

    import numpy as np
    import torch

    from asyncrl.engine.model_runner import ModelRunner
    from asyncrl.engine.triton_decode import longest_first_order

    rng = np.random.default_rng(0)
    for n, bs in ((5, 8), (16, 16), (100, 128)):
        starts = rng.integers(0, 6, n).tolist()  # few distinct lengths: many ties
        seqs = [types.SimpleNamespace(block_table=[i], token_ids=[7]) for i in range(n)]
        batch = types.SimpleNamespace(seqs=seqs, starts=starts, input_src=[-1] * n, block_tables=None)
        runner = types.SimpleNamespace(block_size=16, scratch_block=999, _bt_width=lambda: 2)
        *_, ctx, order = ModelRunner._decode_paged_inputs(runner, batch, bs)
        assert order.dtype == np.int32 and order.tolist() == longest_first_order(torch.from_numpy(ctx)).tolist()


def test_graphed_host_path_equals_gathered_path(tiny_dirs, monkeypatch):
    """Decode steps padded to graph buckets (3 and 12 rows in buckets of 4 and 16) through the graph
    buffers: greedy tokens equal the gathered path's; with the sampler inside the decode graph
    (``decode_graph_sampler``), tokens equal the same sampler run after the graph, log-probs within
    a GEMM's rounding (the graph's LM head also computes the padding rows)."""
    prompts = prompts_for(6, [9, 13, 6])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=2, logprobs=True, ignore_eos=True)
    ref = make_llm(tiny_dirs["qwen3"], async_scheduling=True)
    graphed = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=False)
    for params in (greedy, sampled):
        want, got = ref.generate(prompts, params), graphed.generate(prompts, params)
        for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
            assert a.token_ids == b.token_ids
    after = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=True)
    inside = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=True,
                      graph_sampler=True)
    for params in (greedy, sampled):
        want, got = after.generate(prompts, params), inside.generate(prompts, params)
        for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
            assert a.token_ids == b.token_ids
            # the LM head inside the graph runs the bucket's padded rows too: one GEMM rounding apart
            assert (a.logprobs is None) == (b.logprobs is None)
            assert a.logprobs is None or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert inside.runner.sampling_graph_steps > 0 and after.runner.sampling_graph_steps == 0
    assert graphed.runner.cascade.plans_reused > 0


def test_sampling_graphs_with_the_fused_lm_head_sampler(tiny_dirs, monkeypatch):
    """``model_runner.FUSED_LM_HEAD_SAMPLER``: the sampling decode graphs and the prefills' samples run
    ``triton_lm_sampler`` (the LM head's GEMM with the sampler in its epilogue) and give the unfused engine's tokens,
    log-probs within fp32 sums."""
    from asyncrl.engine import model_runner, triton_lm_sampler

    calls = []
    fused = triton_lm_sampler.lm_head_sample
    monkeypatch.setattr(triton_lm_sampler, "lm_head_sample",
                        lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k))
    prompts = prompts_for(6, [9, 13, 6])
    unfused = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=True,
                       graph_sampler=True)
    monkeypatch.setattr(model_runner, "FUSED_LM_HEAD_SAMPLER", True)
    inside = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=True,
                      graph_sampler=True)
    for params in (SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, ignore_eos=True),
                   SamplingParams(n=4, temperature=0.8, max_tokens=10, seed=2, logprobs=True, ignore_eos=True)):
        want, got = unfused.generate(prompts, params), inside.generate(prompts, params)
        for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the prefills' sample rows (3 prompts; 3 x 4 samples) eagerly, the decode steps in graph buckets of 4 and 16
    assert inside.runner.sampling_graph_steps > 0 and set(calls) == {3, 12, 4, 16}


def test_graphed_host_path_with_concurrent_cascade_equals_gathered_path(tiny_dirs, monkeypatch):
    """``CascadeLaunchRule.concurrent_prefix`` in the engine (the suffix partials and the merge kernel;
    on CPU the two kernels run in sequence): through the graph buckets, greedy and sampled tokens equal
    the gathered path's, and the cascade ran."""
    import dataclasses

    from asyncrl.engine import cascade, triton_decode

    monkeypatch.setattr(cascade, "CASCADE_RULE", dataclasses.replace(cascade.CASCADE_RULE, concurrent_prefix=1,
                                                                     min_chunk_tokens=4))
    calls = []
    concurrent = triton_decode.concurrent_cascade
    monkeypatch.setattr(triton_decode, "concurrent_cascade", lambda *a, **k: (calls.append(1), concurrent(*a, **k))[1])
    prompts = prompts_for(6, [9, 13, 6])
    ref = make_llm(tiny_dirs["qwen3"], async_scheduling=True)
    graphed = _graphed(make_llm(tiny_dirs["qwen3"], async_scheduling=True), monkeypatch, sampler=False)
    for params in (SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True),
                   SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=2, logprobs=True, ignore_eos=True)):
        want, got = ref.generate(prompts, params), graphed.generate(prompts, params)
        for a, b in zip((c for o in want for c in o.completions), (c for o in got for c in o.completions)):
            assert a.token_ids == b.token_ids
    assert graphed.runner.cascade.steps > 0 and calls
