"""``triton_norm.rms_norm``: the decoder's RMSNorm (and the residual add before it) in one Triton kernel against
the torch path (``decoder._rms_norm`` / ``decoder._add_rms_norm``), alone and inside the engine on a GPU.

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the
Triton interpreter; otherwise the module is skipped.
"""

import pytest
import torch
from conftest import skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from asyncrl.engine.models.decoder import _add_rms_norm, _rms_norm  # noqa: E402
from asyncrl.engine.triton_norm import norm_launch, rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _within_one_step(new: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for at most 1% of the values, each one rounding step of ``ref``'s dtype away (the mean's sum
    order moves rsqrt by an fp32 ulp)."""
    differ = new != ref
    assert differ.float().mean().item() <= 0.01
    step = torch.finfo(ref.dtype).eps
    assert ((new.float() - ref.float()).abs()[differ] <= 2 * step * ref.float().abs()[differ] + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,N,launch", [(7, 48, (1, 1)), (7, 48, (4, 2)), (33, 96, (8, 4)), (5, 40, None)])
@pytest.mark.parametrize("add", [False, True])
def test_kernel_matches_torch_path(dtype, T, N, launch, add):
    """norm(x) and (norm(x + residual), x + residual) as the torch path: partial row blocks (T not a multiple of
    the block), a row width that is not a power of two, strided rows (views into wider buffers); the sum x +
    residual bit for bit, the norm within one rounding step (fp32: a few ulps)."""
    torch.manual_seed(T * N + add)
    x = (torch.randn(T, N + 6, device=DEVICE) * 3).to(dtype)[:, 2:2 + N]
    res = (torch.randn(T, N + 3, device=DEVICE) * 3).to(dtype)[:, :N]
    w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    if add:
        out, total = rms_norm(x, w, 1e-6, res, launch=launch)
        ref, ref_total = _add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(total, ref_total)
    else:
        out, ref = rms_norm(x, w, 1e-6, launch=launch), _rms_norm(x, w, 1e-6)
    assert out.shape == (T, N) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        _within_one_step(out, ref)


def test_names_a_bad_layout():
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="is not"):
        rms_norm(torch.zeros(3, 6, device=DEVICE), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(3, 8, device=DEVICE), w, 1e-6, torch.zeros(2, 8, device=DEVICE))


def test_launch_rule_covers_every_row_count():
    for tokens in (1, 7, 188, 256, 257, 4096, 16384, 100_000):
        block_t, warps = norm_launch(tokens)
        assert block_t >= 1 and block_t & (block_t - 1) == 0 and warps >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_with_triton_glue_matches_the_compiled_glue(tiny_dirs, monkeypatch):
    """The engine's CUDA glue kernels (``decoder.TRITON_NORM`` / ``TRITON_SILU``, on by default) against the compiled
    torch glue: fp32 greedy tokens identical and log-probs within 1e-5 (prefill, CUDA-graph decode)."""
    from conftest import prompts_for

    from asyncrl.engine import LLM
    from asyncrl.engine.models import decoder
    from asyncrl.types import SamplingParams

    prompts = prompts_for(5, [37, 50, 21])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(on: bool):
        monkeypatch.setattr(decoder, "TRITON_NORM", on)
        monkeypatch.setattr(decoder, "TRITON_SILU", on)
        llm = LLM(tiny_dirs["qwen3"], dtype=torch.float32, device="cuda", compile_sampler=False, block_size=16,
                  max_num_seqs=8, max_model_len=256)
        return llm.generate(prompts, params)

    off, on = run(False), run(True)
    for a, b in zip(off, on):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(b.completions[0].logprobs), torch.tensor(a.completions[0].logprobs),
                                   rtol=0, atol=1e-5)
