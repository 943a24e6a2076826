"""``triton_qkv.qkv_to_cache`` (EngineConfig.fused_kv_write): the one-kernel q/k norm + RoPE + K/V
cache write against the torch path (``decoder._qkv_prepare`` + ``attention.store_kv``), alone and
inside the engine (prefill and decode, speculative verify, Qwen3 / Qwen2 / Llama / Qwen3-MoE).

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the
Triton interpreter; otherwise the module is skipped.
"""

import pytest
import torch
from conftest import make_llm, prompts_for, skip_unless_triton_runs

from asyncrl.types import SamplingParams

CUDA = skip_unless_triton_runs()

from asyncrl.engine.attention import FP8_KV, raw, store_kv  # noqa: E402
from asyncrl.engine.models.decoder import _qkv_prepare  # noqa: E402
from asyncrl.engine.triton_qkv import qkv_to_cache  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _rope_tables(D: int, max_pos: int = 64):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, FP8_KV)])
@pytest.mark.parametrize("H,Hkv,D,norm", [(4, 2, 16, True), (8, 1, 12, True), (2, 2, 8, False)])
@pytest.mark.parametrize("launch", [(1, 1), (4, 2)])
def test_kernel_matches_torch_path(dtype, cache_dtype, H, Hkv, D, norm, launch):
    """q and both caches as the torch path leaves them: bit-exact in bf16 and FP8 (the same roundings),
    within fp32 ulps in fp32 (rsqrt and the sum's order); slots not written keep their bytes; qkv rows
    may be strided (a view into a wider buffer). ``launch`` (tokens per program, warps): one token a
    program, or blocks of 4 whose last one is partial (7 tokens)."""
    if cache_dtype is FP8_KV and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm89+")
    torch.manual_seed(H * 100 + D)
    T, blocks, page = 7, 5, 4
    wide = (torch.randn(T, (H + 2 * Hkv) * D + 8, device=DEVICE) * 4).to(dtype)
    qkv = wide[:, 3:3 + (H + 2 * Hkv) * D]
    positions = torch.tensor([0, 5, 63, 2, 17, 9, 31], device=DEVICE)
    slots = torch.tensor([3, 17, 0, 9, 19, 20, 6], device=DEVICE)
    cos, sin = _rope_tables(D)
    qw = (torch.rand(D, device=DEVICE) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(D, device=DEVICE) + 0.5).to(dtype) if norm else None
    old_k, old_v = (torch.randn(2, blocks + 1, page, Hkv, D, device=DEVICE) * 2).to(cache_dtype or dtype)
    k_ref, v_ref, k_new, v_new = old_k.clone(), old_v.clone(), old_k.clone(), old_v.clone()
    q_ref, k, v = _qkv_prepare(qkv, positions, cos, sin, qw, kw, 1e-6, H, Hkv, D)
    store_kv(k, v, k_ref, v_ref, slots)
    q = qkv_to_cache(qkv, positions, cos, sin, qw, kw, 1e-6, H, Hkv, D, k_new, v_new, slots, launch=launch)
    assert q.shape == (T, H, D) and q.dtype == dtype
    assert torch.equal(raw(v_new), raw(v_ref))  # v: a copy (and e4m3's saturating cast)
    if dtype == torch.float32:
        torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_new, k_ref, rtol=1e-6, atol=1e-6)
    elif not CUDA:
        assert torch.equal(q, q_ref) and torch.equal(raw(k_new), raw(k_ref))
    else:  # the GPU contracts RoPE's multiply-adds (FMA): a rare value one rounding step away
        for new, ref in ((q, q_ref), (k_new, k_ref)):
            _within_one_step(new, ref)
    untouched = torch.ones(k_new.shape[0] * k_new.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(raw(k_new).flatten(0, 1)[untouched], raw(old_k).flatten(0, 1)[untouched])


def _within_one_step(new: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for at most 1% of the values, each one step of ``ref``'s dtype away."""
    differ = new.float() != ref.float()
    assert differ.float().mean().item() <= 0.01
    step = torch.finfo(ref.dtype).eps  # relative size of one rounding step (<= 2 ulps)
    gap = (new.float() - ref.float()).abs()[differ]
    assert (gap <= 2 * step * ref.float().abs()[differ] + 1e-30).all()


def test_kernel_names_a_bad_layout():
    cos, sin = _rope_tables(8)
    qkv = torch.zeros(3, 5 * 8, device=DEVICE)
    cache = torch.zeros(3, 4, 2, 8, device=DEVICE)
    slots = positions = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="is not"):
        qkv_to_cache(qkv, positions, cos, sin, None, None, 1e-6, 4, 2, 8, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="cache for a"):
        qkv_to_cache(torch.zeros(3, 8 * 8, device=DEVICE), positions, cos, sin, None, None, 1e-6, 4, 2, 8,
                     cache.half(), cache.half(), slots)


def _fused(llm):
    """Turn the fused path on in every attention layer (ModelRunner does it on CUDA only)."""
    layers = llm.runner._attention_layers()
    for attn in layers:
        attn.fused_kv_write = True
    return llm


@pytest.mark.skipif(CUDA, reason="the CPU engine; tests/engine/test_gpu.py covers the CUDA one")
def test_engine_fused_matches_torch_path(tiny_dirs, tmp_path, monkeypatch):
    """Greedy tokens and log-probs equal with the fused write on and off: chunked prefill, prefix
    sharing (n = 2), decode, and a speculative (n-gram) verify step, for the dense families and MoE."""
    from families import build_family

    from asyncrl.engine import triton_qkv

    launches = []
    monkeypatch.setattr(triton_qkv, "qkv_to_cache",
                        lambda *a, **k: launches.append(a[0].shape[0]) or qkv_to_cache(*a, **k))

    prompts = prompts_for(3, [9, 14])
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    paths = [tiny_dirs["qwen3"], tiny_dirs["qwen2"], tiny_dirs["llama"], build_family("qwen3_moe", tmp_path)]
    for path in paths:
        kw = dict(max_num_batched_tokens=16)
        off = make_llm(path, **kw).generate(prompts, params)
        on_llm = _fused(make_llm(path, **kw))
        on = on_llm.generate(prompts, params)
        for a, b in zip(off, on):
            for ca, cb in zip(a.completions, b.completions):
                assert ca.token_ids == cb.token_ids, path
                torch.testing.assert_close(torch.tensor(cb.logprobs), torch.tensor(ca.logprobs), rtol=0, atol=1e-5)
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    repeat = [[5, 6, 7, 8] * 4]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    off = make_llm(tiny_dirs["qwen3"], **spec).generate(repeat, greedy)
    on_llm = _fused(make_llm(tiny_dirs["qwen3"], **spec))
    on = on_llm.generate(repeat, greedy)
    assert on[0].completions[0].token_ids == off[0].completions[0].token_ids
    assert on_llm.metrics["spec_steps"] > 0 and on_llm.metrics["spec_accepted_tokens"] > 0
    assert len(launches) > 20 and max(launches) > 4  # prefill chunks, decode rows and verify steps ran fused


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_with_fused_write_matches_hf(tiny_dirs):
    """EngineConfig.fused_kv_write (on by default on CUDA; graphs captured over the kernel, cascade decode of
    shared prompts): fp32 greedy tokens equal HF's for Qwen3 (q/k norm), Qwen2 (qkv bias) and Llama;
    with an FP8 cache the fused engine's tokens equal the torch path's."""
    from transformers import AutoModelForCausalLM
    from conftest import hf_greedy_loop

    from asyncrl.engine import LLM

    prompts = prompts_for(23, [37, 50, 21])
    params = SamplingParams(n=4, temperature=0.0, max_tokens=24, ignore_eos=True)

    def llm(path, **kw):
        return LLM(path, dtype=torch.float32, device="cuda", compile_sampler=False, block_size=16, max_num_seqs=32,
                   max_model_len=256, **kw)

    for family in ("qwen3", "qwen2", "llama"):
        hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).cuda().eval()
        on = llm(tiny_dirs[family])  # the default on CUDA
        assert on.runner.graphs and all(a.fused_kv_write for a in on.runner._attention_layers())
        outs = on.generate(prompts, params)
        assert on.runner.cascade.steps > 0
        for p, o in zip(prompts, outs):
            assert [c.token_ids for c in o.completions] == [hf_greedy_loop(hf, p, 24)] * 4, family
    if torch.cuda.get_device_capability() >= (8, 9):
        fp8 = dict(kv_cache_dtype="fp8")
        off = llm(tiny_dirs["qwen3"], fused_kv_write=False, **fp8).generate(prompts, params)
        on = llm(tiny_dirs["qwen3"], fused_kv_write=True, **fp8).generate(prompts, params)
        assert [[c.token_ids for c in o.completions] for o in on] == [[c.token_ids for c in o.completions] for o in off]
