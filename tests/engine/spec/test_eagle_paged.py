"""The EAGLE head's GPU draft steps (paged K/V read in place by the Triton decode kernel, every
step's inputs in one copy) draft exactly what the gathered CPU path drafts: the GPU code path on
CPU tensors through the Triton interpreter (``TRITON_INTERPRET=1``), else skipped. The engines
here live on the CPU, so a compiled Triton kernel cannot read them: on a GPU the same path runs
natively in tests/engine/spec/test_spec_gpu.py (captured round graphs vs eager rounds, fp32)."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU engines through the Triton interpreter: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from conftest import make_llm, prompts_for  # noqa: E402
from test_eagle import _spec, target, trained_head  # noqa: E402,F401
sys_path_engine = os.path.join(os.path.dirname(__file__), "..")
import sys  # noqa: E402
sys.path.insert(0, sys_path_engine)
from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401

from asyncrl.types import SamplingParams  # noqa: E402


def _drafts(llm, params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) -> list:
    proposer, seen = llm.spec.proposer, []
    propose = proposer.propose

    def recording(batch, budgets):
        ids, counts, probs = propose(batch, budgets)
        seen.append(ids.tolist())
        return ids, counts, probs

    proposer.propose = recording
    llm.generate(prompts_for(4, [5, 7, 9]), params)
    return seen


def test_paged_draft_steps_equal_the_gathered_ones(target, trained_head):  # noqa: F811
    # adaptive off: both engines run the same rounds (the speed gate's choices follow wall time)
    gathered = make_llm(target, speculative_config=_spec(trained_head, adaptive=False))
    gathered.spec.proposer.paged = False
    paged = make_llm(target, speculative_config=_spec(trained_head, adaptive=False))
    paged.spec.proposer.paged = True
    assert _drafts(paged) == _drafts(gathered)
    assert paged.metrics["spec_accepted_tokens"] > 0


class _EagerGraph:
    """Stands in for a captured CUDA graph: ``replay`` runs the captured step on its buffers."""

    replays = 0

    def __init__(self, step, bs):
        self.step, self.bs = step, bs

    def replay(self):
        _EagerGraph.replays += 1
        self.step(self.bs)


@pytest.mark.parametrize("sampling", ["greedy", "probabilistic"])
def test_graph_buffers_draft_what_the_gathered_path_drafts(target, trained_head, monkeypatch, sampling):  # noqa: F811
    """The GPU graph round (catch-up padded to Q entries per row on the paged kernel from the
    verify pass's features, then the draft steps; static buffers per bucket filled by one copy,
    padding rows on the scratch block) with the capture replaced by an eager replay of the same
    step: 3 running rows replay the 4-row bucket; only a sequence's first round (features from a
    target forward) runs eagerly."""
    import asyncrl.engine.spec.draft_model as draft_model  # capture_rounds (both proposers' capture) lives there

    monkeypatch.setattr(draft_model, "capture_graphs",
                        lambda sizes, *steps, **_: [{b: _EagerGraph(s, b) for b in sizes} for s in steps])
    monkeypatch.setattr(_EagerGraph, "replays", 0)
    spec = _spec(trained_head, draft_sampling=sampling, adaptive=False)  # the same rounds in both engines
    params = SamplingParams(temperature=0 if sampling == "greedy" else 0.8, seed=0, max_tokens=12, ignore_eos=True)
    gathered = make_llm(target, speculative_config=spec)
    gathered.spec.proposer.paged = False
    graphs = make_llm(target, speculative_config=spec)
    proposer = graphs.spec.proposer
    proposer.paged = True
    proposer._capture([1, 2, 4])
    assert _drafts(graphs, params) == _drafts(gathered, params)
    assert graphs.metrics["spec_accepted_tokens"] > 0 and _EagerGraph.replays == proposer.rounds["graph"]
    assert proposer.rounds == {"graph": graphs.metrics["spec_steps"] - 1, "eager": 1}
