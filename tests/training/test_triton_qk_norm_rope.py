"""The Triton q/k RMSNorm + RoPE and RMSNorm kernels against float64 autograd of HF's formulas,
and the fused varlen attention (fused_attention.py) against HF's Qwen3 attention in the varlen
layout: log-probs, entropies and every parameter's gradient.

On a CUDA machine these run on the GPU; on a CPU through the Triton interpreter when it is asked
for (``TRITON_INTERPRET=1`` and triton installed), else skip. The plan's gating runs anywhere.
"""
import copy
import importlib.util
import os
import pickle

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.training import fused_attention, kernels
from asyncrl.training.forward_plan import ForwardPlan, _fused_attention, plan_of, prepare_model

CUDA = torch.cuda.is_available()
RUNS_TRITON = importlib.util.find_spec("triton") is not None and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="needs CUDA, or TRITON_INTERPRET=1 with triton installed")
DEVICE = "cuda" if CUDA else "cpu"


def _inv_freq(dim, theta):
    """HF's fp32 inv_freq = theta^(-2i/D), computed on the CPU (as HF's rotary embedding at init):
    the kernel and the reference get the same tensor (CUDA's fp32 pow differs from the CPU's in
    the last bit, which moves an angle of ~60 rad by ~4e-6)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _reference(x, w, eps, positions=None, inv_freq=None):
    """float64 HF: w * (x rsqrt(mean x^2 + eps)), then rotate_half RoPE with ``inv_freq`` [D/2] fp32."""
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    if positions is None:
        return y
    D = x.shape[-1]
    freqs = positions[:, None].float() * inv_freq.to(x.device)  # fp32, as HF's rotary embedding
    emb = torch.cat([freqs, freqs], -1).double()
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rotated = torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1)
    return y * cos + rotated * sin


def _check(ours_fn, ref_fn, x, w):
    """Values, dx and dw of fp32 ``ours_fn`` against float64 ``ref_fn`` under a random upstream."""
    g = torch.Generator().manual_seed(1)
    xs, ws = x.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    xd, wd = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
    ours, ref = ours_fn(xs, ws), ref_fn(xd, wd)
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(x.device)
    (ours * up.float()).sum().backward()
    (ref * up).sum().backward()
    assert ours.dtype == torch.float32 and ours.shape == ref.shape and ours.is_contiguous()
    torch.testing.assert_close(ours.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xs.grad.double(), xd.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ws.grad.double(), wd.grad, atol=1e-5 * (x.numel() / x.shape[-1]) ** 0.5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("H", [1, 2, 16])
@pytest.mark.parametrize("D", [64, 128])
def test_qk_norm_rope_matches_float64(T, H, D, monkeypatch):
    """x [T, H, D] fp32, positions out of order with repeats (varlen layouts restart them per
    prompt), weights away from 1: y, dx and dw (the per-program partial sums over several tiles:
    TARGET_PROGRAMS shrunk so that backward programs loop over tiles as at the peer shape)."""
    from asyncrl.training import triton_qk_norm_rope
    from asyncrl.training.triton_qk_norm_rope import qk_norm_rope

    monkeypatch.setattr(triton_qk_norm_rope, "TARGET_PROGRAMS", 2)

    g = torch.Generator().manual_seed(T * 1000 + H * 10 + D)
    x = (torch.randn(T, H, D, generator=g, dtype=torch.float64) * 3).to(DEVICE)
    w = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5).to(DEVICE)
    positions = torch.randint(0, 3000, (T,), generator=g).to(DEVICE)
    inv_freq = _inv_freq(D, 1e6).to(DEVICE)  # Qwen3's rope_theta
    _check(lambda x, w: qk_norm_rope(x, w, 1e-6, positions, inv_freq),
           lambda x, w: _reference(x, w, 1e-6, positions, inv_freq), x, w)


@needs_triton
@pytest.mark.parametrize("shape", [(3, 96), (300, 64), (2, 13, 1024)])
def test_rms_norm_matches_float64(shape, monkeypatch):
    """The hidden states' RMSNorm: rows of a non-power-of-two half (96), several tiles per
    backward program with a masked tail (300 rows of 64, 26 of 1024), a leading batch dim and
    D = 1024 (Qwen3-0.6B's hidden size)."""
    from asyncrl.training import triton_qk_norm_rope
    from asyncrl.training.triton_qk_norm_rope import rms_norm

    monkeypatch.setattr(triton_qk_norm_rope, "TARGET_PROGRAMS", 2)

    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)
    w = (torch.rand(shape[-1], generator=g, dtype=torch.float64) + 0.5).to(DEVICE)
    _check(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: _reference(x, w, 1e-6), x, w)


@needs_triton
def test_head_dim_80_on_a_strided_view_of_the_heads():
    """head_dim 80 (halves of 40 in 64-wide blocks) on every other head of [T, 2H, D] (a strided
    view: made contiguous; the skipped heads get no gradient)."""
    from asyncrl.training.triton_qk_norm_rope import qk_norm_rope

    g = torch.Generator().manual_seed(80)
    x = torch.randn(5, 4, 80, generator=g, dtype=torch.float64).to(DEVICE)
    w = (torch.rand(80, generator=g, dtype=torch.float64) + 0.5).to(DEVICE)
    positions = torch.tensor([0, 1, 2, 0, 1]).to(DEVICE)
    inv_freq = _inv_freq(80, 10000.0).to(DEVICE)
    _check(lambda x, w: qk_norm_rope(x[:, ::2], w, 1e-6, positions, inv_freq),
           lambda x, w: _reference(x[:, ::2], w, 1e-6, positions, inv_freq), x, w)


# -- the fused attention in a model -----------------------------------------------------------

def _model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=1e4)
    return Qwen3ForCausalLM(Qwen3Config(**{**config, **overrides}))


def _batch():
    """Two prompt groups (left-padded prompts of 5 and 7 tokens), responses of 0-6 tokens."""
    g = torch.Generator().manual_seed(3)
    P, L = 7, 6
    ids = torch.randint(1, 61, (5, P + L), generator=g)
    ids[:3, :P] = ids[0, :P]
    ids[3:, :P] = ids[3, :P]
    attn = torch.ones_like(ids)
    attn[:3, :2] = 0  # group 0's prompt: 5 tokens
    for row, length in enumerate([2, 6, 0, 5, 1]):
        attn[row, P + length:] = 0
    return ids, attn, attn[:, P:].clone(), P


def _values_and_grads(model, ids, attn, mask, P):
    from asyncrl.training.logprobs import response_logprobs

    model.zero_grad()
    lp, ent = response_logprobs(model, ids, attn, P, 0.8, with_entropy=True)
    ((lp + 0.1 * ent) * mask).sum().backward()
    return (lp * mask).double(), (ent * mask).double(), [p.grad.clone() for p in model.parameters()]


@needs_triton
def test_fused_attention_equals_hf_attention_in_the_varlen_layout():
    """fp32: the fused [T, H, D] forward (Triton norms, q/k RMSNorm + RoPE, one gather, varlen
    attend, o_proj) gives HF's Qwen3Attention + RMSNorm log-probs, entropies and gradients of
    every parameter (q/k norm weights included) in the varlen layout, to 1e-5."""
    hf = _model().to(DEVICE)
    fused = copy.deepcopy(hf)
    assert kernels.apply_fused_attention(fused) == 2 * (2 + 2 + 1) + 1  # 4 norms per layer, the final one
    for model in (hf, fused):
        prepare_model(model, "eager", "varlen")
    ids, attn, mask, P = (t.to(DEVICE) if torch.is_tensor(t) else t for t in _batch())
    ours = _values_and_grads(fused, ids, attn, mask, P)
    ref = _values_and_grads(hf, ids, attn, mask, P)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-5, rtol=1e-5)
    names = [n for n, _ in hf.named_parameters()]
    assert any("q_norm" in n for n in names)
    for name, a, b in zip(names, ours[2], ref[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@needs_triton
def test_fused_attention_without_the_varlen_layout_is_hf_forward():
    """A padded forward (no varlen rows in the kwargs) runs HF's attention, through the Triton
    norms: the logits equal HF's; the swapped classes survive deepcopy and pickle as HF's."""
    hf = _model().to(DEVICE)
    fused = copy.deepcopy(hf)
    kernels.apply_fused_attention(fused)
    ids = torch.randint(1, 61, (2, 9)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    attn_type = type(fused.model.layers[0].self_attn)
    assert attn_type.__name__ == "FusedQwen3Attention"
    assert type(copy.deepcopy(fused).model.layers[1].self_attn) is attn_type
    assert type(pickle.loads(pickle.dumps(fused)).model.layers[0].self_attn) is type(hf.model.layers[0].self_attn)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert set(fused.state_dict()) == set(hf.state_dict())


@needs_triton
def test_activation_checkpointing_recomputes_the_fused_attention():
    """Per-layer checkpointing (recompute.py): the recomputation in backward takes the fused
    forward again (the varlen rows travel in the layer's kwargs) and gives the same gradients."""
    from asyncrl.training.recompute import enable_activation_checkpointing

    model = _model().to(DEVICE)
    kernels.apply_fused_attention(model)
    prepare_model(model, "eager", "varlen")
    model.train()
    ids, attn, mask, P = (t.to(DEVICE) if torch.is_tensor(t) else t for t in _batch())
    plain = _values_and_grads(model, ids, attn, mask, P)
    enable_activation_checkpointing(model)
    checkpointed = _values_and_grads(model, ids, attn, mask, P)
    for a, b in zip(plain[2], checkpointed[2]):
        torch.testing.assert_close(a, b)


def test_apply_liger_with_the_fused_attention_swaps_norms_and_attention():
    """The liger body with fused_attention: SwiGLU by Liger, every RMSNorm by the Triton kernel,
    every attention by the fused forward; names unchanged (runs nothing: CPU)."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert kernels.apply_liger(model, fused_attention=True) == 2 * (1 + 4 + 1) + 1
    layer = model.model.layers[0]
    assert type(layer.mlp).__name__ == "LigerQwen3MLP"
    assert {type(m).__name__ for m in (layer.input_layernorm, layer.self_attn.q_norm, model.model.norm)} == \
        {"TritonQwen3RMSNorm"}
    assert type(layer.self_attn).__name__ == "FusedQwen3Attention"
    assert layer.self_attn.__dict__["_asyncrl_rotary"] is model.model.rotary_emb
    assert [n for n, _ in model.named_parameters()] == names


def test_the_plan_takes_the_fused_attention_only_where_it_applies(monkeypatch):
    """varlen on CUDA with a default-RoPE Qwen3 only; other RoPE types are refused by name, a
    note says why; it is on by default, off with ASYNCRL_FUSED_ATTENTION=0; describe() says which path runs."""
    cuda, notes = torch.device("cuda"), []
    monkeypatch.setenv("ASYNCRL_FUSED_ATTENTION", "0")
    assert not _fused_attention(_model(), "varlen", cuda, notes) and notes == []  # turned off: no note
    monkeypatch.delenv("ASYNCRL_FUSED_ATTENTION")
    assert _fused_attention(_model(), "varlen", cuda, notes) == kernels.triton_available() and notes == []
    assert not _fused_attention(_model(), "tree", cuda, notes)
    assert not _fused_attention(_model(), "varlen", torch.device("cpu"), notes)
    if kernels.triton_available():
        yarn = _model(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                       "original_max_position_embeddings": 64})
        assert not _fused_attention(yarn, "varlen", cuda, notes) and "rope_type 'yarn'" in notes[-1]
        monkeypatch.setenv("ASYNCRL_FUSED_ATTENTION", "0")
        assert not _fused_attention(_model(), "varlen", cuda, notes)
    assert "attention=fused" in ForwardPlan(body="liger", layout="varlen", attention="fused").describe()
    assert "attention" not in ForwardPlan().describe()
    assert fused_attention.fused_attention_unsupported_reason(_model()) is None
    model = _model()
    model.config.model_type = "llama"
    assert "is not one of" in fused_attention.fused_attention_unsupported_reason(model)
    assert plan_of(_model()).attention == "hf"


@pytest.mark.gpu
def test_fused_plan_matches_the_liger_plan_on_gpu(monkeypatch):
    """bf16 on CUDA: actor.kernels=liger in the varlen layout takes the fused attention, and its
    log-probs and gradients are the Liger plan's (ASYNCRL_FUSED_ATTENTION=0) and the eager
    plan's to bf16 rounding."""
    from asyncrl.training.logprobs import response_logprobs

    if not kernels.liger_available():
        pytest.skip("liger-kernel not installed")
    base = _model(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64).cuda().bfloat16()
    ids = torch.randint(1, 1000, (6, 70), device="cuda")
    ids[3:, :30] = ids[3, :30]
    ids[:3, :30] = ids[0, :30]
    mask = torch.ones_like(ids)
    mask[1, 55:] = 0
    outs = []
    for kernels_choice, fused in (("eager", "0"), ("liger", "0"), ("liger", "1")):
        monkeypatch.setenv("ASYNCRL_FUSED_ATTENTION", fused)
        model = copy.deepcopy(base)
        plan = prepare_model(model, kernels_choice, "varlen")
        assert plan.attention == ("fused" if kernels_choice == "liger" and fused == "1" else "hf")
        lp, ent = response_logprobs(model, ids, mask, 30, 0.9, with_entropy=True)
        real = mask[:, 30:].bool()
        ((lp - 0.01 * ent) * real).sum().backward()
        outs.append(((lp * real).float(), [p.grad.float() for p in model.parameters()]))
    for other in outs[:2]:
        torch.testing.assert_close(outs[2][0], other[0], atol=0.05, rtol=0.05)
        for a, b in zip(outs[2][1], other[1]):
            assert float((a - b).norm() / b.norm().clamp(min=1e-6)) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 1024])
def test_bf16_kernels_match_float64_on_gpu(D):
    """bf16 on CUDA at a few thousand rows (many tiles per backward program): within bf16 rounding."""
    from asyncrl.training.triton_qk_norm_rope import qk_norm_rope, rms_norm

    g = torch.Generator().manual_seed(D)
    T, H = 3000, (16 if D == 128 else 1)
    x = torch.randn(T, H, D, generator=g).cuda()
    w = (torch.rand(D, generator=g) + 0.5).cuda()
    positions = torch.randint(0, 4096, (T,), generator=g).cuda()
    inv_freq = _inv_freq(D, 1e6).cuda()
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    xd, wd = xb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    if D == 128:
        ours, ref = qk_norm_rope(xb, wb, 1e-6, positions, inv_freq), _reference(xd, wd, 1e-6, positions, inv_freq)
    else:
        ours, ref = rms_norm(xb, wb, 1e-6), _reference(xd, wd, 1e-6)
    up = torch.randn(ref.shape, generator=g).cuda()
    (ours.float() * up).sum().backward()
    (ref * up.double()).sum().backward()
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), ref.detach(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(xb.grad.double(), xd.grad, atol=5e-2, rtol=2e-2)
    assert float((wb.grad.double() - wd.grad).norm() / wd.grad.norm()) < 1e-2
