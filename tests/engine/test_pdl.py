"""``engine.pdl``: programmatic dependent launch of the engine's Triton kernels.

PDL only changes when a kernel may start, never what it computes: on a GPU the engine with it on returns the same
tokens and the same log-probs, bit for bit, as with it off (CUDA-graph decode with split-KV and the sampler's two
kernels included). On CPU it is never used.
"""

import pytest
import torch

from asyncrl.engine import pdl


def test_off_the_gpu_kernels_launch_plainly():
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_the_switch_turns_it_off_everywhere(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert not pdl.use_pdl(device)
    assert pdl.launch_options(device) == {"USE_PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_pdl_equals_without(tiny_dirs, monkeypatch):
    from conftest import prompts_for

    from asyncrl.engine import LLM
    from asyncrl.types import SamplingParams

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9")
    prompts = prompts_for(5, [37, 50, 21])
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=0.8, max_tokens=24, seed=5, ignore_eos=True)

    def run(on: bool):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.use_pdl(torch.device("cuda")) == on
        llm = LLM(tiny_dirs["qwen3"], dtype=torch.bfloat16, device="cuda", block_size=16, max_num_seqs=16,
                  max_model_len=256)
        assert llm.runner.graphs
        outs = [llm.generate(prompts, p) for p in (greedy, sampled)]
        llm.close()
        return [[(c.token_ids, c.logprobs) for c in o.completions] for out in outs for o in out]

    off, on = run(False), run(True)
    assert on == off
