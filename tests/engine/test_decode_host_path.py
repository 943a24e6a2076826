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
