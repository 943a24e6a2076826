"""``triton_gemm``: the decode layer's GEMMs with the residual add, RMSNorm and SwiGLU inside them, against the torch
path (``F.linear`` and ``decoder``'s glue), alone and as the engine's layer (``decoder.TRITON_GEMM``).

On a GPU it runs natively; on CPU with ``TRITON_INTERPRET=1`` (and triton installed) through the Triton interpreter,
in fp32 (the interpreter's bf16 ``tl.dot`` is not the GPU's); otherwise the module is skipped.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_llm, prompts_for, skip_unless_triton_runs

CUDA = skip_unless_triton_runs()

from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401 (autouse: numpy 2 in the interpreter)

from asyncrl.engine.models import decoder  # noqa: E402
from asyncrl.engine.models.decoder import _rms_norm, _silu_and_mul  # noqa: E402
from asyncrl.engine.triton_gemm import launch, linear_residual, norm_linear, sum_squares  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def _close(new: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: a few ulps (sum orders); bf16: within two rounding steps where they differ, and few differ."""
    if new.dtype == torch.float32:
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
        return
    differ = new != ref
    assert differ.float().mean().item() <= 0.02
    step = torch.finfo(ref.dtype).eps
    assert ((new.float() - ref.float()).abs()[differ] <= 4 * step * ref.float().abs()[differ] + 1e-6).all()


def _tensors(T, K, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    res = (torch.randn(T, N, generator=g) * 2).to(DEVICE, dtype)
    return x, w, res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N", [(1, 64, 64), (5, 48, 96), (70, 128, 64)])
def test_linear_residual_is_the_residual_plus_the_rounded_gemm(dtype, T, K, N):
    """h = residual + round(x W^T) (rows not a multiple of the row tile, a last column tile half out of range, K
    tiles of 16); the partials sum to the row sums of h^2, one partial per column tile."""
    x, w, res = _tensors(T, K, N, dtype, T * K + N)
    h, ss = linear_residual(x, w, res)
    ref = (F.linear(x, w).float() + res.float()).to(dtype)
    _close(h, ref)
    assert ss.shape == (T, -(-N // launch("residual", K, N)[1])) and ss.dtype == torch.float32
    torch.testing.assert_close(ss.sum(1), (h.float() ** 2).sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N,partials,bias", [(3, 64, 128, "gemm", False), (33, 96, 80, "torch", True),
                                                 (70, 128, 32, "gemm", True)])
def test_norm_linear_is_rmsnorm_then_the_gemm(dtype, T, K, N, partials, bias):
    """rmsnorm(h) W^T (+ b) with the norm from row-sum partials (a producing GEMM's, or ``sum_squares``' single
    one)."""
    x, w_in, res = _tensors(T, K, K, dtype, 7 + T)
    h, ss = linear_residual(x, w_in, res)
    if partials == "torch":
        ss = sum_squares(h)
    g = torch.Generator().manual_seed(T)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    _close(norm_linear(h, ss, nw, w, 1e-6, bias=b), F.linear(_rms_norm(h, nw, 1e-6), w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,inter", [(4, 64, 64), (37, 128, 48)])
def test_norm_linear_swiglu_is_the_mlps_first_half(dtype, T, K, inter):
    """silu(gate) * up of rmsnorm(h) [W_gate; W_up]^T in one kernel (a last column tile past ``inter``: masked)."""
    h, _, _ = _tensors(T, K, 8, dtype, 11 + T)
    g = torch.Generator().manual_seed(inter)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(2 * inter, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    out = norm_linear(h, sum_squares(h), nw, w, 1e-6, inter=inter)
    assert out.shape == (T, inter)
    _close(out, _silu_and_mul(F.linear(_rms_norm(h, nw, 1e-6), w), inter))


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.float32, "fp8")]
                         + ([(torch.bfloat16, None), (torch.bfloat16, "fp8")] if CUDA else []))
@pytest.mark.parametrize("H,Hkv,D,norm,T,bias", [(4, 2, 32, True, 7, False), (2, 1, 64, False, 70, True)])
def test_norm_qkv_to_cache_is_the_gemm_then_the_qkv_kernel(dtype, cache_dtype, H, Hkv, D, norm, T, bias):
    """The RMSNorm + qkv GEMM + q/k norm + RoPE + K/V write kernel against ``norm_linear`` then ``triton_qkv``'s
    kernel: q and both caches (bf16 / e4m3 within one rounding step: the two dots' K order), slots not written keep
    their bytes; a partial row tile (70 rows); a qkv bias (Qwen2: no q/k norm)."""
    from asyncrl.engine.attention import FP8_KV, raw
    from asyncrl.engine.triton_gemm import norm_qkv_to_cache
    from asyncrl.engine.triton_qkv import qkv_to_cache

    cdt = FP8_KV if cache_dtype else dtype
    K, blocks, page = 64, 40, 4
    x, w_o, res = _tensors(T, K, K, dtype, H * D + T)
    h, ss = linear_residual(x, w_o, res)
    g = torch.Generator().manual_seed(D)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE, dtype)
    w = (torch.randn((H + 2 * Hkv) * D, K, generator=g) / K ** 0.5 * 3).to(DEVICE, dtype)
    qw, kw = ((torch.rand(2, D, generator=g) + 0.5).to(DEVICE, dtype) if norm else (None, None))
    positions = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    slots = torch.randperm((blocks + 1) * page, generator=g)[:T].to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    emb = torch.outer(torch.arange(64, dtype=torch.float), inv).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    old_k, old_v = (torch.randn(2, blocks + 1, page, Hkv, D, generator=g) * 2).to(DEVICE, cdt)
    k_ref, v_ref, k_new, v_new = old_k.clone(), old_v.clone(), old_k.clone(), old_v.clone()
    b = torch.randn(w.shape[0], generator=g).to(DEVICE, dtype) if bias else None
    qkv = norm_linear(h, ss, nw, w, 1e-6, bias=b, config=launch("norm", K, D))
    q_ref = qkv_to_cache(qkv, positions, cos, sin, qw, kw, 1e-5, H, Hkv, D, k_ref, v_ref, slots)
    q = norm_qkv_to_cache(h, ss, nw, w, 1e-6, positions, cos, sin, qw, kw, 1e-5, H, Hkv, D, k_new, v_new, slots,
                          bias=b)
    assert q.shape == (T, H, D) and q.dtype == dtype
    for new, ref in ((q, q_ref), (k_new, k_ref), (v_new, v_ref)):
        if cdt == torch.float32:
            torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
        else:  # bf16 or e4m3: the same roundings after a GEMM whose K order may differ
            _close(new.float().to(torch.bfloat16) if new.dtype == FP8_KV else new,
                   ref.float().to(torch.bfloat16) if ref.dtype == FP8_KV else ref)
    untouched = torch.ones((blocks + 1) * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(raw(k_new).flatten(0, 1)[untouched], raw(old_k).flatten(0, 1)[untouched])
    assert torch.equal(raw(v_new).flatten(0, 1)[untouched], raw(old_v).flatten(0, 1)[untouched])


def _mean_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return (got.double() - truth).abs().mean().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N,inter,bias", [(3, 64, 128, None, False), (70, 128, 80, None, True),
                                              (37, 128, None, 48, False)])
def test_folded_norm_linear_is_rmsnorm_then_the_gemm(dtype, T, K, N, inter, bias):
    """``folded=True`` with ``fold_norm``'s weight computes the same product as the norm prologue: fp32 within a few
    ulps of the engine's path; bf16 (another rounding of it) no further from the float64 truth than the engine's
    path, on average. SwiGLU and a bias (added after the row scale, as it is not normalised) included."""
    from asyncrl.engine.triton_gemm import fold_norm

    x, w_in, res = _tensors(T, K, K, dtype, 5 + T)
    h, ss = linear_residual(x, w_in, res)
    g = torch.Generator().manual_seed(K + T)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE, dtype)
    w = (torch.randn(2 * inter if inter else N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    got = norm_linear(h, ss, None, fold_norm(w, nw), 1e-6, inter=inter, bias=b, folded=True)
    engine = norm_linear(h, ss, nw, w, 1e-6, inter=inter, bias=b)
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    truth = F.linear(normed, w.double(), None if b is None else b.double())
    if inter:
        truth = F.silu(truth[:, :inter]) * truth[:, inter:]
    assert got.shape == engine.shape == truth.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, engine, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.equal(got, engine)  # a different rounding: the flag is not a no-op
        assert _mean_error(got, truth) <= 1.25 * _mean_error(engine, truth)


def test_fold_norm_scales_columns_and_refills_in_place():
    from asyncrl.engine.triton_gemm import fold_norm

    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.bfloat16)
    nw = torch.tensor([0.5, 2.0, 1.0], dtype=torch.bfloat16)
    out = fold_norm(w, nw)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[0.5, 4.0, 3.0], [2.0, 10.0, 6.0]]
    again = fold_norm(w * 2, nw, out)
    assert again is out and out.tolist() == [[1.0, 8.0, 6.0], [4.0, 20.0, 12.0]]


@pytest.mark.parametrize("D,norm,bias", [(32, True, False), (64, False, True)])
def test_folded_norm_qkv_to_cache_is_the_norm_prologues(D, norm, bias):
    """The qkv epilogue kernel on the folded weight: q and both caches as the norm-prologue kernel writes them
    (fp32)."""
    from asyncrl.engine.triton_gemm import fold_norm, norm_qkv_to_cache

    H, Hkv, T, K, blocks, page = 4, 2, 9, 64, 8, 4
    x, w_o, res = _tensors(T, K, K, torch.float32, D)
    h, ss = linear_residual(x, w_o, res)
    g = torch.Generator().manual_seed(D)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    w = (torch.randn((H + 2 * Hkv) * D, K, generator=g) / K ** 0.5 * 3).to(DEVICE)
    qw, kw = ((torch.rand(2, D, generator=g) + 0.5).to(DEVICE) if norm else (None, None))
    b = torch.randn(w.shape[0], generator=g).to(DEVICE) if bias else None
    positions = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    slots = torch.randperm((blocks + 1) * page, generator=g)[:T].to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    emb = torch.outer(torch.arange(64, dtype=torch.float), inv).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    caches = [torch.zeros(2, blocks + 1, page, Hkv, D, device=DEVICE) for _ in range(2)]
    args = (positions, cos, sin, qw, kw, 1e-5, H, Hkv, D)
    q_ref = norm_qkv_to_cache(h, ss, nw, w, 1e-6, *args, caches[0][0], caches[0][1], slots, bias=b)
    q = norm_qkv_to_cache(h, ss, None, fold_norm(w, nw), 1e-6, *args, caches[1][0], caches[1][1], slots, bias=b,
                          folded=True)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], rtol=1e-5, atol=1e-5)
    assert caches[1].abs().sum() > 0


def test_launch_fits_k_and_n():
    assert launch("residual", 1024, 1024) == (64, 32, 128, 4, 4)
    assert launch("norm", 48, 96)[1:3] == (64, 16)  # 96 columns: 64-wide tiles; K 48: 16-deep tiles
    assert launch("norm", 40, 64) is None  # no power-of-two K tile >= 16 divides 40
    assert launch("swiglu", 64, 8) is None


def _engine(path):
    """A tiny fp32 engine: the CPU one (kernels through the interpreter), or on a GPU one with its CUDA graphs."""
    if not CUDA:
        return make_llm(path)
    from asyncrl.engine import LLM

    return LLM(path, dtype=torch.float32, device="cuda", compile_sampler=False, block_size=16, max_num_seqs=8,
               max_model_len=256)


def _greedy(llm):
    prompts = prompts_for(5, [9, 13, 6])
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, logprobs=True, ignore_eos=True))


def _same_completions(off, on) -> None:
    for a, b in zip(off, on):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(b.completions[0].logprobs), torch.tensor(a.completions[0].logprobs),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_engine_layers_through_the_fused_gemms_give_the_same_tokens(tiny_dirs, monkeypatch, arch):
    """The engine with ``TRITON_GEMM`` on (and the norms in the GEMMs' prologues, not folded) runs every layer
    through ``forward_fused`` (a prefill of 28 rows and the decode steps) and gives the torch path's greedy tokens,
    log-probs within 1e-5 (fp32; on a GPU through its CUDA graphs)."""
    from asyncrl.engine import triton_gemm

    calls = []
    made = triton_gemm.norm_linear
    monkeypatch.setattr(triton_gemm, "norm_linear", lambda *a, **k: calls.append(a[0].shape[0]) or made(*a, **k))
    monkeypatch.setattr(decoder, "FOLD_NORMS", False)  # the norm prologues (folding: the next test)
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    off = _greedy(_engine(tiny_dirs[arch]))
    assert calls == []
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    llm = _engine(tiny_dirs[arch])
    on = _greedy(llm)
    layers = len(llm.runner.model.model.layers)
    prefill = [9 + 13 + 6] * (2 * layers)  # the prefill: two norm_linear calls per layer
    if CUDA:  # after the CUDA-graph captures (each bucket's rows); the decode steps replay the graphs: no calls
        start = calls.index(9 + 13 + 6)
        assert calls[start:start + 2 * layers] == prefill
    else:  # the prefill, then the 9 decode steps of 3 rows
        assert calls == prefill + [3] * (2 * layers * 9)
    _same_completions(off, on)


def test_folded_norms_give_the_same_tokens_and_follow_weight_syncs(tiny_dirs, hf_models, monkeypatch):
    """``FOLD_NORMS`` (with ``TRITON_GEMM``): the torch path's greedy tokens and log-probs (fp32); a weight sync
    refolds the copies in place, so the engine then equals a fresh engine built on the new weights, and the old
    weights sent back restore the first outputs."""
    from asyncrl.engine import triton_gemm

    hf = hf_models["qwen3"]
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    off = _greedy(_engine(tiny_dirs["qwen3"]))
    folded_calls = []
    made = triton_gemm.norm_linear
    monkeypatch.setattr(triton_gemm, "norm_linear",
                        lambda *a, **k: folded_calls.append(k.get("folded")) or made(*a, **k))
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    monkeypatch.setattr(decoder, "FOLD_NORMS", True)
    llm = _engine(tiny_dirs["qwen3"])
    first = _greedy(llm)
    _same_completions(off, first)
    assert folded_calls and all(folded_calls)
    layer = llm.runner.model.model.layers[0]
    address = layer.folded_weights()[0].data_ptr()
    original = {n: t.clone() for n, t in hf.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    moved = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
    llm.update_weights(moved.items(), version=1)
    assert layer.folded_weights()[0].data_ptr() == address
    expected = triton_gemm.fold_norm(layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight)
    assert torch.equal(layer.folded_weights()[0], expected)
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    fresh = _engine(tiny_dirs["qwen3"])
    fresh.update_weights(moved.items(), version=1)
    reference = _greedy(fresh)
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    _same_completions(reference, _greedy(llm))
    llm.update_weights(original.items(), version=2)
    _same_completions(first, _greedy(llm))


def test_folded_weights_are_made_before_the_kv_pool_is_sized(tiny_dirs, monkeypatch):
    """``prepare_fused_gemms`` makes every layer's folded (qkv, gate_up) copies where decode forwards will fold and
    returns their bytes, none where they will not (``FOLD_NORMS`` off, or the fused path off); a GPU engine has them
    before its first forward, so its KV pool was sized with them in memory."""
    from asyncrl.engine.models import load_model

    def fresh():
        return load_model(tiny_dirs["qwen3"], dtype=torch.float32, device=DEVICE).model

    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    model = fresh()
    expected = sum(4 * (layer.self_attn.qkv_proj.weight.numel() + layer.mlp.gate_up_proj.weight.numel())
                   for layer in model.layers)
    assert model.prepare_fused_gemms(torch.float32, DEVICE) == expected > 0
    assert all(layer._folded is not None for layer in model.layers)
    monkeypatch.setattr(decoder, "FOLD_NORMS", False)
    unfolded = fresh()
    assert unfolded.prepare_fused_gemms(torch.float32, DEVICE) == 0
    assert all(layer._folded is None for layer in unfolded.layers)
    monkeypatch.setattr(decoder, "FOLD_NORMS", True)
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    assert fresh().prepare_fused_gemms(torch.float32, DEVICE) == 0
    if CUDA:
        monkeypatch.setattr(decoder, "TRITON_GEMM", True)
        llm = _engine(tiny_dirs["qwen3"])
        assert llm.runner.folded_weight_bytes == expected
        assert all(layer._folded is not None for layer in llm.runner.model.model.layers)


@pytest.fixture(scope="module")
def qwen3_head32(tmp_path_factory):
    """A tiny Qwen3 with 32-wide heads: the smallest the qkv epilogue (``norm_qkv_to_cache``) takes."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512,
                      rms_norm_eps=1e-6, eos_token_id=3, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if p.shape[0] == 97 else 0.15)
    path = tmp_path_factory.mktemp("qwen3_head32")
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("epilogue", [True, False])
def test_the_qkv_epilogue_gives_the_same_tokens(qwen3_head32, monkeypatch, epilogue):
    """With the K/V write fused (a GPU engine's default; on CPU the engine switched onto its GPU host path: paged
    decode kernels), ``TRITON_GEMM`` runs the q/k norm + RoPE + K/V write in the qkv GEMM's epilogue
    (``TRITON_GEMM_QKV``, or ``triton_qkv``'s kernel after ``norm_linear`` without it): the torch path's tokens."""
    from asyncrl.engine import triton_gemm
    from asyncrl.engine.cascade import CascadeBuffers

    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    off = _greedy(_engine(qwen3_head32))
    calls = []
    made = triton_gemm.norm_qkv_to_cache
    monkeypatch.setattr(triton_gemm, "norm_qkv_to_cache", lambda *a, **k: calls.append(1) or made(*a, **k))
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    monkeypatch.setattr(decoder, "TRITON_GEMM_QKV", epilogue)
    llm = _engine(qwen3_head32)
    if not CUDA:
        r = llm.runner
        r.cascade = CascadeBuffers(r.num_heads, r.num_kv_heads, r.block_size, llm.config.max_num_seqs, r.device)
        r.is_cuda = True
        for layer in r.model.model.layers:
            layer.self_attn.fused_kv_write = True
    _same_completions(off, _greedy(llm))
    assert (len(calls) > 0) == epilogue


def test_layers_the_kernels_cannot_run_keep_the_torch_path(tiny_dirs, monkeypatch):
    """A bias on another projection than qkv, a projection replaced by another module (LoRA, FP8), too many rows,
    weights in another dtype: the torch path."""
    from torch import nn

    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    qwen2 = make_llm(tiny_dirs["qwen2"]).runner.model.model.to(DEVICE)
    x = torch.zeros(4, 64, device=DEVICE)
    assert qwen2.fits_fused_gemms(x)  # its q/k/v biases go into the qkv kernels
    qwen2.layers[0].mlp.down_proj.bias = nn.Parameter(torch.zeros(64, device=DEVICE))
    assert not qwen2.fits_fused_gemms(x) and not qwen2.layers[0].fits_fused_gemms(torch.float32)
    qwen3 = make_llm(tiny_dirs["qwen3"]).runner.model.model.to(DEVICE)
    assert qwen3.fits_fused_gemms(x)
    assert not qwen3.fits_fused_gemms(torch.zeros(513, 64, device=DEVICE))
    assert not qwen3.fits_fused_gemms(x.to(torch.bfloat16))  # weights in another dtype
    qwen3.layers[1].mlp.down_proj = nn.Sequential(qwen3.layers[1].mlp.down_proj)
    assert not qwen3.fits_fused_gemms(x)
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    assert not make_llm(tiny_dirs["qwen3"]).runner.model.model.fits_fused_gemms(x)


def test_the_benchs_chains_compute_the_same_layers(monkeypatch):
    """``bench/fused_layer.py`` times the engine's kernels against the fused ones: at a small shape in fp32 its
    chains give the same last hidden state and q."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "bench" / "fused_layer.py"
    spec = importlib.util.spec_from_file_location("fused_layer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(bench.SHAPES, "tiny", (64, 96, 4, 2, 32))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    layers = bench.layer_weights("tiny", 3, g, torch.float32)
    step = bench.Step("tiny", 5, g, torch.float32)
    want_h, want_q = bench.engine_chain(step, layers)
    folded = bench.fold_layers(layers)
    for chain in [*bench.CHAINS.values(), lambda step, _: bench.folded_chain(step, folded)]:
        h, q = chain(step, layers)
        torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
