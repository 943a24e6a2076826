"""The verify step's GPU graph path on CPU tensors (``TRITON_INTERPRET=1``, else skipped, as
test_eagle_paged): every input staged in one copy, the target pass on the paged kernel, the LM
head, and for one-hot drafts without top-k / top-p the sampler + verifier inside the "graph"
(the capture replaced by an eager replay of the same step), one packed read-back. Tokens and
log-probs equal speculation off (gathered CPU path), through rejections, forks, padding rows
(3 rows replay the 4-row bucket) and preemption; filtered rows take the eager tail on the graph's
logits. On a GPU the captured graphs run natively in test_spec_gpu.py."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU engines through the Triton interpreter: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import assert_same_completions, build_tiny, make_llm, prompts_for  # noqa: E402
from test_decoding import REPETITIVE  # noqa: E402

import asyncrl.engine.spec.verify_step as verify_step  # noqa: E402
from asyncrl.engine.sampler import sample  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402

sys_path_engine = os.path.join(os.path.dirname(__file__), "..")
import sys  # noqa: E402
sys.path.insert(0, sys_path_engine)
from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("verify_target"))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # every step verifies (no speed gate)


class _EagerGraph:
    """Stands in for a captured CUDA graph: ``replay`` runs the captured step on its buffers."""

    def __init__(self, step, bs):
        self.step, self.bs = step, bs

    def replay(self):
        self.step(self.bs)


def _unfiltered(logits, temperature, keys):
    """What the Triton one-pass kernel computes (``triton_sampler.sample_unfiltered``)."""
    zeros = torch.zeros_like(keys)
    return sample(logits, temperature, zeros, torch.ones_like(temperature), keys, use_filter=False)


def test_graph_path_equals_speculation_off(target, monkeypatch):
    monkeypatch.setattr(verify_step, "capture_graphs", lambda sizes, step, **_: [{b: _EagerGraph(step, b) for b in sizes}])
    prompts = REPETITIVE[:2] + prompts_for(3, [6])
    unfiltered = SamplingParams(temperature=1.0, max_tokens=20, seed=3, ignore_eos=True, n=2)  # 6 rows: bucket 8
    cases = {"graph_tail": [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), unfiltered],
             "graph": [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=20, seed=5, ignore_eos=True)]}
    preempted = 0
    for path, params_list in cases.items():
        for params in params_list:
            off = make_llm(target, num_kv_blocks=24).generate(prompts, params)
            llm = make_llm(target, num_kv_blocks=24, speculative_config=NGRAM)
            step = llm.spec.verify_step
            step.tail_sampler, step.tail_in_graph = _unfiltered, True
            step._capture([1, 2, 4, 8])
            on = llm.generate(prompts, params)
            assert [c.token_ids for o in on for c in o.outputs] == [c.token_ids for o in off for c in o.outputs]
            assert_same_completions(off, on, atol=1e-4)
            assert step.rounds[path] > 0 and llm.metrics["spec_accepted_tokens"] > 0, (path, step.rounds)
            assert step.rounds["eager"] <= 1  # only a batch above the largest bucket runs eagerly
            preempted += llm.metrics["preemptions"]
    assert preempted > 0  # the small pool preempted
