"""FP8 rollout on a GPU (Hopper or newer): the Triton token-group and per-token quantizations equal
the torch ones bit for bit, the ``F.scaled_mm`` blockwise and ``torch._scaled_mm`` rowwise GEMMs equal
the dequantize -> fp32 matmul references (same e4m3 inputs: only accumulation order and the bf16
output rounding differ), and the engine with ``quantization="fp8"`` (either ``fp8_scaling``) in bf16
gives the same tokens with and without CUDA graphs and stays within FP8's error of the HF model.
Skipped without CUDA or FP8 tensor cores."""
import pytest
import torch

from asyncrl.engine import fp8_channel
from asyncrl.engine.fp8 import (fp8_matmul_reference, fp8_matmul_scaled_mm, padded_k, quantize_tokens,
                                quantize_weight)
from asyncrl.types import SamplingParams

from conftest import prompts_for

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU with FP8 (sm90+)")]

# Qwen3-0.6B's linears (N, K): qkv, o, gate_up, down; and a shape that needs padding
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (200, 700)]
ROWS = [1, 3, 4, 37, 256, 2048]


def assert_equal_up_to_accumulation(fast, ref, x, w):
    """``fast`` (FP8 tensor cores) vs ``ref`` (dequantize -> fp32 matmul), same e4m3 inputs: two bf16
    roundings (2^-7 of the value) plus the accumulation's error, which scales with the sum of the
    terms' magnitudes, not with the result: Hopper's FP8 MMA keeps only ~14 mantissa bits in its
    accumulator (DeepSeek-V3 report, sec. 3.3.2), so an output that cancels (|ref| << sum |x w|) can
    differ by far more than its own ulps. ``x [M, K]``, ``w [N, K]`` (bf16, before quantization)."""
    terms = x.float().abs() @ w.float().abs().t()
    err = (fast.float()[:, :w.shape[0]] - ref.float()[:, :w.shape[0]]).abs()
    bound = 2 ** -7 * ref.float()[:, :w.shape[0]].abs() + 2 ** -13 * terms + 1e-6
    worst = (err / bound).max().item()
    assert worst <= 1, f"error {worst:.2f}x the bound (max abs error {err.max().item():.3g})"


@pytest.mark.parametrize("scaling", ["block", "channel"])
@pytest.mark.parametrize("k", [1024, 3072, 700])
def test_triton_quantization_equals_torch(k, scaling):
    """Per token per 128 channels (block: rows padded to 4, scales M-major) and per token (channel)."""
    from asyncrl.engine.triton_fp8 import quantize_rows_cuda, quantize_tokens_cuda

    g = torch.Generator(device="cuda").manual_seed(0)
    for m in ROWS:
        x = (torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-3, 2, m, device="cuda")[:, None])
        x = x.to(torch.bfloat16)
        x[0, :128] = 0  # an all-zero group
        if scaling == "block":
            q, scale = quantize_tokens(x, padded_k(k))
            q_t, scale_t = quantize_tokens_cuda(x, padded_k(k))
            assert q_t.shape[0] % 4 == 0 and scale_t.shape == (padded_k(k) // 128, q_t.shape[0])
            assert not q_t[m:].float().any()  # padding rows are zeros
            q_t, scale_t = q_t[:m], scale_t.t()[:m]
        else:
            q, scale = fp8_channel.quantize_rows(x, fp8_channel.padded_k(k))
            q_t, scale_t = quantize_rows_cuda(x, fp8_channel.padded_k(k))
        assert torch.equal(scale_t, scale)
        same = q_t.view(torch.uint8) == q.view(torch.uint8)
        assert same.all(), f"m={m}: {(~same).sum().item()} of {same.numel()} e4m3 values differ"


@pytest.mark.parametrize("n,k", SHAPES[:4] + [(208, 700)])
def test_rowwise_scaled_mm_equals_the_reference(n, k):
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    wq, ws = fp8_channel.quantize_rows(w, fp8_channel.padded_k(k))
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        fast = fp8_channel.matmul_scaled_mm(x, wq, ws)
        ref = fp8_channel.matmul_reference(x, wq, ws)
        assert fast.shape == ref.shape == (m, n) and fast.dtype == torch.bfloat16
        assert_equal_up_to_accumulation(fast, ref, x, w)
        plain = x @ w.t()
        rel = ((fast.float() - plain.float()).norm() / plain.float().norm()).item()
        assert 1e-3 < rel < 0.08


@pytest.mark.parametrize("n,k", SHAPES)
def test_scaled_mm_equals_the_reference(n, k):
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    wq, ws = quantize_weight(w, padded_k(k))
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        fast = fp8_matmul_scaled_mm(x, wq, ws)
        ref = fp8_matmul_reference(x, wq, ws)
        assert fast.shape == ref.shape == (m, wq.shape[0]) and fast.dtype == torch.bfloat16
        assert_equal_up_to_accumulation(fast, ref, x, w)
        plain = x @ w.t()
        rel = ((fast[:, :n].float() - plain.float()).norm() / plain.float().norm()).item()
        assert 1e-3 < rel < 0.08  # FP8's error against the bf16 GEMM: present, a few percent


@pytest.mark.parametrize("scaling", ["block", "channel"])
def test_gpu_engine_fp8_graphs_equal_eager_and_track_the_model(tiny_dirs, hf_models, scaling):
    from asyncrl.engine import LLM

    def llm(**kw):
        return LLM(tiny_dirs["qwen3"], dtype=torch.bfloat16, device="cuda", block_size=16, max_model_len=256,
                   gpu_memory_utilization=0.3, quantization="fp8", fp8_scaling=scaling, **kw)

    prompts = prompts_for(6, [5, 9, 7, 12])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=3, logprobs=True, ignore_eos=True)
    graphed, eager = llm().generate(prompts, params), llm(enforce_eager=True).generate(prompts, params)
    hf, diffs, same, total = hf_models["qwen3"], [], 0, 0
    for a, b, p in zip(graphed, eager, prompts):
        for ca, cb in zip(a.completions, b.completions):
            # graphs pad the batch to a bucket, so cuBLAS may pick another kernel for another M: bf16
            # rounding can differ, and a near-tie may then sample another token; up to there, equal
            n = next((i for i, (x, y) in enumerate(zip(ca.token_ids, cb.token_ids)) if x != y), len(ca.token_ids))
            same, total = same + n, total + len(ca.token_ids)
            torch.testing.assert_close(torch.tensor(ca.logprobs[:n]), torch.tensor(cb.logprobs[:n]), atol=2e-2, rtol=0)
            ids = torch.tensor([p + ca.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ca.token_ids)[:, None]).squeeze(1)
            diffs.append((torch.tensor(ca.logprobs) - ref).abs())
    assert same >= 0.8 * total
    assert 1e-3 < torch.cat(diffs).mean().item() < 0.5  # the CPU test's band (0.16 there, fp32 + FP8)


def test_gpu_fp8_kv_cache_cascade_and_graphs_agree(tiny_dirs, hf_models):
    """``kv_cache_dtype="fp8"`` on the GPU kernels (paged decode, cascade prefix + suffix, CUDA
    graphs), in fp32 (IEEE dots: the paths differ by summation order only): greedy groups of 4
    sharing a 40-token prompt give the same tokens with cascade on/off and graphs on/off, and stay
    within the FP8 cache's error of the HF model."""
    from asyncrl.engine import LLM

    def llm(**kw):
        return LLM(tiny_dirs["qwen3"], dtype=torch.float32, device="cuda", block_size=16, max_model_len=256,
                   gpu_memory_utilization=0.3, kv_cache_dtype="fp8", **kw)

    prompts = prompts_for(7, [40, 37])
    params = SamplingParams(n=4, temperature=0.0, max_tokens=16, logprobs=True, ignore_eos=True)
    runs = [llm().generate(prompts, params), llm(cascade_attention=False).generate(prompts, params),
            llm(enforce_eager=True).generate(prompts, params)]
    first = runs[0]
    for other in runs[1:]:
        for a, b in zip(first, other):
            for ca, cb in zip(a.completions, b.completions):
                assert ca.token_ids == cb.token_ids
                torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-4, rtol=0)
    hf = hf_models["qwen3"]
    sampled = LLM(tiny_dirs["qwen3"], dtype=torch.float32, device="cuda", block_size=16, max_model_len=256,
                  gpu_memory_utilization=0.3, kv_cache_dtype="fp8").generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=2, logprobs=True, ignore_eos=True))
    diffs = []
    for p, o in zip(prompts, sampled):
        for c in o.completions:
            with torch.no_grad():
                logits = hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            diffs.append((torch.tensor(c.logprobs) - ref).abs())
    assert 1e-4 < torch.cat(diffs).mean().item() < 0.3  # the CPU test's band (0.045 there)
