"""The engine behind the RolloutBackend protocol, built from an in-memory HF model."""
import torch
from conftest import hf_greedy, prompts_for

from asyncrl.rollout.base import RolloutBackend
from asyncrl.rollout.engine_backend import EngineBackend
from asyncrl.types import SamplingParams


def test_engine_backend_protocol_and_weight_push(hf_models):
    hf = hf_models["qwen3"]
    backend = EngineBackend(hf, device="cpu", block_size=4, max_num_seqs=8)
    assert isinstance(backend, RolloutBackend) and backend.version == 0
    prompts = prompts_for(12, [5, 8])
    outs = backend.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=6))
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, o in zip(prompts, outs):
        assert all(c.token_ids == hf_greedy(hf, p, 6) for c in o.completions)
    scaled = [(k, v * 0.5 if v.dim() == 2 else v) for k, v in hf.state_dict().items()]
    backend.update_weights(scaled, version=3)
    out = backend.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))[0].completions[0]
    assert backend.version == 3 and out.versions == [3] * len(out.token_ids)
    assert backend.metrics["prefill_tokens"] > 0


def test_engine_backend_kv_on_update_is_passed_to_the_engine(hf_models):
    """``runtime.partial_rollout_kv``: with "recompute" a weight push mid-generation sends the
    running sequences back to waiting with no K/V (re-prefilled on the new weights); with
    "keep" they stay running on their blocks."""
    hf = hf_models["qwen3"]
    for kv, running_after in (("keep", 2), ("recompute", 0)):
        backend = EngineBackend(hf, device="cpu", block_size=4, max_num_seqs=8, kv_on_update=kv)
        llm = backend.llm
        llm.add_request(prompts_for(3, [6])[0], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=0))
        for _ in range(3):
            llm.step()
        backend.update_weights(hf.state_dict().items(), version=1)
        assert len(llm.scheduler.running) == running_after
        assert all(not s.block_table and s.num_cached_tokens == 0 for s in llm.scheduler.waiting) or kv == "keep"
        while llm.has_unfinished():
            llm.step()
        assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
