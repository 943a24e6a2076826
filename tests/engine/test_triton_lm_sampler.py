"""``triton_lm_sampler.lm_head_sample``: the LM head's GEMM with the one-pass sampler in its epilogue, against
``triton_sampler.sample_unfiltered(F.linear(hidden, weight), ...)`` and the torch ``sample``; inside the engine's
sampling decode graphs (``model_runner.FUSED_LM_HEAD_SAMPLER``) on a GPU.

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the Triton interpreter,
in fp32 (the interpreter's bf16 ``tl.dot`` is not the GPU's); otherwise the module is skipped. The engine on the
CPU's run of the GPU host path: ``tests/engine/test_decode_host_path.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401 (autouse: numpy 2 in the interpreter)

from asyncrl.engine.sampler import row_keys, sample  # noqa: E402
from asyncrl.engine.triton_lm_sampler import LAUNCH, fits, lm_head_sample  # noqa: E402
from asyncrl.engine.triton_sampler import sample_unfiltered  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
TEMPS = [1.0, 0.0, 0.7, 1.0, 1.3]


def _case(B, K, V, dtype, seed, temps=TEMPS):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, K, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(V, K, generator=g) * 3 / K ** 0.5).to(DEVICE, dtype)
    temp = torch.tensor([temps[i % len(temps)] for i in range(B)], dtype=torch.float32, device=DEVICE)
    keys = row_keys(torch.arange(B) + 100 * seed, torch.zeros(B, dtype=torch.long), torch.arange(B)).to(DEVICE)
    return hidden, weight, temp, keys


@pytest.mark.parametrize("B,K,V,config", [(5, 64, 1000, (64, 128, 64, 4, 1, 0)), (70, 32, 517, (64, 64, 32, 4, 1, 1)),
                                          (1, 64, 300, None)])
@pytest.mark.parametrize("all_unit", [False, True])
def test_equals_the_gemm_then_the_one_pass_sampler(B, K, V, config, all_unit):
    """Tokens equal and log-probs within fp32 sums of ``sample_unfiltered`` on ``F.linear``'s logits: greedy and
    tempered rows mixed (the divisions) or every row at T = 1 (the skipped divisions), a vocabulary that is not a
    multiple of the tile, rows past the row tile's end, several tiles per program and one."""
    hidden, weight, temp, keys = _case(B, K, V, torch.float32, B + V, [1.0] if all_unit else TEMPS)
    tokens, logprobs = lm_head_sample(hidden, weight, temp, keys, config=config)
    want_tokens, want_logprobs = sample_unfiltered(F.linear(hidden, weight), temp, keys)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    ref_tokens, ref_logprobs = sample(F.linear(hidden, weight), temp, torch.zeros(B, dtype=torch.long, device=DEVICE),
                                      torch.ones(B, device=DEVICE), keys, False)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


def test_greedy_ties_go_to_the_first_index():
    """Rows whose largest logit repeats in two vocab tiles (and twice in one): the first index, as torch.argmax."""
    hidden, weight, temp, keys = _case(3, 32, 400, torch.float32, 7, [0.0])
    hidden[:, 0] = 10.0
    weight[5] = 0.0
    weight[5, 0] = 10.0  # logit 100 in every row, far above the rest
    weight[[37, 38, 300]] = weight[5].clone()  # and again at 37, 38 (one tile) and 300 (another)
    tokens, _ = lm_head_sample(hidden, weight, temp, keys, config=(64, 64, 32, 4, 1, 0))
    assert tokens.tolist() == F.linear(hidden, weight).argmax(-1).tolist() == [5, 5, 5]


@pytest.mark.skipif(not CUDA, reason="bf16 dots: GPU")
def test_bf16_on_the_gpu():
    """bf16 at the 0.6B head's width: tokens equal where the top two race values are apart (a logit one rounding
    step from cuBLAS's may flip a near tie), log-probs within bf16's rounding of the logits."""
    hidden, weight, temp, keys = _case(256, 1024, 151936, torch.bfloat16, 1)
    tokens, logprobs = lm_head_sample(hidden, weight, temp, keys)
    want_tokens, want_logprobs = sample_unfiltered(F.linear(hidden, weight), temp, keys)
    assert (tokens == want_tokens).float().mean().item() >= 0.99
    same = tokens == want_tokens
    torch.testing.assert_close(logprobs[same], want_logprobs[same], rtol=0, atol=0.05)


def test_fits_names_what_it_takes():
    hidden, weight, _, _ = _case(4, 64, 300, torch.float32, 0)
    assert fits(hidden, weight)
    assert not fits(hidden.double(), weight)
    assert not fits(hidden[:, 1:49], weight[:, 1:49].contiguous())  # a view off 16-byte alignment
    assert LAUNCH[2] >= 16


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_sampling_graphs_with_the_fused_head(tiny_dirs, monkeypatch):
    """The engine with ``FUSED_LM_HEAD_SAMPLER`` (fp32; its prefills' samples and its sampling decode graphs):
    greedy and sampled tokens equal the unfused engine's, log-probs within 1e-5."""
    from conftest import prompts_for

    from asyncrl.engine import LLM, model_runner
    from asyncrl.types import SamplingParams

    prompts = prompts_for(5, [37, 50, 21])

    def run(on: bool):
        monkeypatch.setattr(model_runner, "FUSED_LM_HEAD_SAMPLER", on)
        llm = LLM(tiny_dirs["qwen3"], dtype=torch.float32, device="cuda", block_size=16, max_num_seqs=8,
                  max_model_len=256, decode_graph_sampler=True)
        return [llm.generate(prompts, p) for p in (
            SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, ignore_eos=True),
            SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=3, logprobs=True, ignore_eos=True))], llm

    (off, _), (on, llm) = run(False), run(True)
    assert llm.runner.sampling_graph_steps > 0
    for a_run, b_run in zip(off, on):
        for a, b in zip((c for o in a_run for c in o.completions), (c for o in b_run for c in o.completions)):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
