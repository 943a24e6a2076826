"""The draft model's GPU graph round (inputs staged by one copy, paged K/V read in place by the
Triton decode kernel) drafts exactly what the CPU eager round drafts: the graph step on CPU tensors
through the Triton interpreter (``TRITON_INTERPRET=1``), else skipped, with the capture replaced by an
eager replay of the captured step. On a GPU the real capture runs in tests/engine/spec/test_spec_gpu.py."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU engines through the Triton interpreter: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from conftest import make_llm, prompts_for  # noqa: E402
from test_decoding import REPETITIVE, perturbed_draft, target  # noqa: E402,F401
from test_eagle_paged import _EagerGraph  # noqa: E402
sys_path_engine = os.path.join(os.path.dirname(__file__), "..")
import sys  # noqa: E402
sys.path.insert(0, sys_path_engine)
from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401

from asyncrl.types import SamplingParams  # noqa: E402


def _rounds(llm, params) -> tuple[list, list]:
    """(drafts per round, whether q came with them) of one generation."""
    proposer, seen, with_q = llm.spec.proposer, [], []
    propose = proposer.propose

    def recording(batch, budgets):
        ids, counts, probs = propose(batch, budgets)
        seen.append(ids.tolist())
        with_q.append(None if probs is None else probs.clone())
        return ids, counts, probs

    proposer.propose = recording
    llm.generate(REPETITIVE[:2] + prompts_for(4, [7]), params)
    return seen, with_q


@pytest.mark.parametrize("sampling,temperature", [("greedy", 0), ("probabilistic", 0), ("probabilistic", 0.8)])
def test_graph_round_drafts_what_the_eager_round_drafts(target, perturbed_draft, monkeypatch, sampling,  # noqa: F811
                                                        temperature):
    """3 running rows replay the 4-row bucket (one padding row); a probabilistic config replays its
    argmax graph on greedy rows (no q) and its q graph on sampled ones (the same q as the eager round)."""
    import torch

    import asyncrl.engine.spec.draft_model as draft_model

    monkeypatch.setattr(draft_model, "capture_graphs",
                        lambda sizes, *steps, **_: [{b: _EagerGraph(s, b) for b in sizes} for s in steps])
    spec = {"method": "draft_model", "model": perturbed_draft, "num_speculative_tokens": 3, "draft_sampling": sampling,
            "adaptive": False}  # the same rounds in both engines (the speed gate's choices follow wall time)
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=12, ignore_eos=True)
    eager = make_llm(target, speculative_config=spec)
    graphs = make_llm(target, speculative_config=spec)
    graphs.spec.proposer._capture([1, 2, 4])
    assert set(graphs.spec.proposer.prob_graphs) == ({1, 2, 4} if sampling == "probabilistic" else set())
    monkeypatch.setattr(_EagerGraph, "replays", 0)
    d_graph, q_graph = _rounds(graphs, params)
    d_eager, q_eager = _rounds(eager, params)
    assert d_graph == d_eager and _EagerGraph.replays == len(d_graph)
    assert all((q is None) == (sampling == "greedy" or temperature == 0) for q in q_graph)
    for a, b in zip(q_graph, q_eager):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-5)
    assert graphs.metrics["spec_accepted_tokens"] > 0
