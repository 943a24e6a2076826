"""bench/spec_step_parts.py: every speculative step split into its timed parts (the catch-up inside
the proposal), the catch-up steps written out; the patch leaves the engine's tokens unchanged."""
from __future__ import annotations

import atexit
import importlib.util
import json
from pathlib import Path

from conftest import make_llm, prompts_for
from test_adaptive import head, slow_speculation, target  # noqa: F401 (fixtures)

from asyncrl.engine.spec import decoding
from asyncrl.types import SamplingParams

BENCH = Path(__file__).resolve().parents[3] / "bench" / "spec_step_parts.py"


def test_parts_of_every_step_and_the_catch_ups_are_recorded(target, head, tmp_path, monkeypatch):  # noqa: F811
    spec = importlib.util.spec_from_file_location("spec_step_parts", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(decoding.SpeculativeDecoder, "step", decoding.SpeculativeDecoder.step)  # undone after
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    out = tmp_path / "parts.json"
    records = bench.install(str(out))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = prompts_for(4, [6, 9])
    off = make_llm(target).generate(prompts, params)
    llm = make_llm(target, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3})
    slow_speculation(llm, spec_cost=3.0)  # plain stretches, then catch-ups
    on = llm.generate(prompts, params)
    assert [c.token_ids for o in on for c in o.outputs] == [c.token_ids for o in off for c in o.outputs]
    assert len(records) == llm.metrics["spec_steps"]
    for r in records:
        assert {"schedule", "propose", "verify", "postprocess", "total"} <= set(r) and r["proposer"] == "EagleProposer"
        assert r["propose"] + r["verify"] <= r["total"] and r.get("catch_up", 0.0) <= r["propose"]
    registered[0]()  # what runs at exit
    written = json.loads(out.read_text())
    assert written["steps"] == len(records) and written["catch_up_steps"]
    assert all(r["catch_up_tokens"] > 0 for r in written["catch_up_steps"])
    assert sum(r["catch_up_tokens"] for r in written["catch_up_steps"]) == llm.metrics["spec_catch_up_tokens"]
