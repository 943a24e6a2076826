"""The trainer's CPU forms of Qwen3.5's token mixer (asyncrl/training/gdn_cpu.py) equal
transformers' torch functions: outputs, final states and gradients, alone and inside the whole
model's training forward/backward (fp64 and fp32 models). transformers' delta rule computes in
fp32 whatever the input dtype, so every comparison is to fp32 rounding (1e-5)."""

import pytest
import torch

transformers_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from asyncrl.config import TinyModelConfig  # noqa: E402
from asyncrl.data.char_tokenizer import build_char_tokenizer  # noqa: E402
from asyncrl.training import gdn_cpu, hf_kernels  # noqa: E402
from asyncrl.training.logprobs import response_logprobs  # noqa: E402
from asyncrl.training.model import build_tiny_model  # noqa: E402

HF_CHUNK = hf_kernels.torch_function_of(transformers_qwen3_5.torch_chunk_gated_delta_rule)
HF_CONV = hf_kernels.torch_function_of(transformers_qwen3_5.causal_conv1d_fn)


@pytest.mark.parametrize("length, chunk", [(1, 1), (18, 18), (64, 64), (65, 33), (130, 44), (128, 64), (200, 50)])
def test_chunk_size_is_the_row_up_to_64_then_an_even_split(length, chunk):
    assert gdn_cpu.chunk_size_for(length) == chunk


def _delta_inputs(batch, length, k_heads, v_heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, length, k_heads, dim), (batch, length, k_heads, dim), (batch, length, v_heads, dim + 3)]
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes)
    g = -torch.rand(batch, length, v_heads, generator=gen, dtype=torch.float64) * 2  # log-decay <= 0
    beta = torch.rand(batch, length, v_heads, generator=gen, dtype=torch.float64)
    state = torch.randn(batch, v_heads, dim, dim + 3, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


def _close(got, want, tol=1e-5, name=""):
    """Equal to ``tol`` relative to the reference's largest entry (fp32 rounding of sums)."""
    torch.testing.assert_close(got, want, rtol=0, atol=tol * max(1.0, float(want.abs().max())), msg=name or None)


def _run(fn, inputs):
    q, k, v, g, beta, state = inputs
    out, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    ((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum() + final.square().sum()).backward()
    return out.detach(), final.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("length", [1, 7, 18, 64, 70, 129])
def test_short_row_delta_rule_equals_transformers_chunks_of_64(length):
    """Rows shorter than, equal to and past one 64-token chunk; grouped heads (2 key heads, 4
    value heads), an initial state: outputs, final state and every input's gradient to 1e-5
    (fp32 rounding: both compute in fp32)."""
    fast = gdn_cpu.short_row_delta_rule(HF_CHUNK)
    out, final, grads = _run(fast, _delta_inputs(3, length, 2, 4, 8, seed=length))
    ref_out, ref_final, ref_grads = _run(HF_CHUNK, _delta_inputs(3, length, 2, 4, 8, seed=length))
    _close(out, ref_out)
    _close(final, ref_final)
    for grad, ref in zip(grads, ref_grads):
        _close(grad, ref)


@pytest.mark.parametrize("with_bias, activation", [(False, "silu"), (True, None)])
def test_shifted_conv_equals_transformers_conv1d(with_bias, activation):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(10, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    leaves = [t for t in (x, weight, bias) if t is not None]

    def grads(fn):
        out = fn(x, weight, bias, activation=activation)
        probe = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
        return [out.detach(), *torch.autograd.grad((out * probe).sum(), leaves)]

    for got, want in zip(grads(gdn_cpu.causal_conv1d_fn), grads(HF_CONV)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _tiny_qwen3_5(dtype):
    tok = build_char_tokenizer()
    cfg = TinyModelConfig(architecture="qwen3_5", hidden_size=32, num_hidden_layers=4, head_dim=8,
                          intermediate_size=64)
    return build_tiny_model(cfg, tok, seed=0).to(dtype), len(tok)


def _grpo_batch(vocab):
    """8 rows: 2 prompts x 4 responses, prompts left-padded, responses right-padded ([8, 9 + 5])."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (8, 14), generator=gen)
    ids[:, :9] = ids[::4, :9].repeat_interleave(4, 0)
    mask = torch.ones_like(ids)
    mask[:4, :3] = 0
    mask[1, 11:] = 0
    mask[6, 10:] = 0
    return ids, mask


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.float32, 1e-5)])
def test_model_training_forward_backward_equals_transformers_forms(dtype, tol):
    """The trainer's log-probs/entropies of a hybrid (3 GDN + 1 attention layer) model and every
    parameter's gradient are transformers' own torch path's to rounding."""
    model, vocab = _tiny_qwen3_5(dtype)
    ids, mask = _grpo_batch(vocab)

    def run():
        model.zero_grad()
        logprobs, entropy = response_logprobs(model, ids, mask, 9, temperature=0.7, with_entropy=True)
        real = mask[:, 9:].to(logprobs.dtype)
        ((logprobs * real).sum() + 0.1 * (entropy * real).sum()).backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logprobs, entropy, grads = run()
    with hf_kernels.transformers_torch_forms():
        ref_logprobs, ref_entropy, ref_grads = run()
    _close(logprobs, ref_logprobs, tol)
    _close(entropy, ref_entropy, tol)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        _close(grad, ref_grads[name], tol, name)
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if "linear_attn" in n)  # GDN layers train


def test_cpu_dispatch_takes_the_short_row_forms_unless_told_otherwise(monkeypatch):
    """The model's calls reach gdn_cpu's forms by default and transformers' inside
    ``transformers_torch_forms`` (which is what the equality above compares)."""
    hf_kernels.route_cpu_to_torch_kernels()
    calls = []
    real = gdn_cpu.chunk_size_for
    monkeypatch.setattr(gdn_cpu, "chunk_size_for", lambda *a: calls.append(a) or real(*a))
    model, vocab = _tiny_qwen3_5(torch.float32)
    ids, mask = _grpo_batch(vocab)
    with torch.no_grad():
        response_logprobs(model, ids, mask, 9)
        # per Gated DeltaNet layer: the prompts' pass (9 tokens), then the responses' continuation (5)
        assert [length for length, _ in calls] == [9, 9, 9, 5, 5, 5]
        with hf_kernels.transformers_torch_forms():
            response_logprobs(model, ids, mask, 9)
    assert len(calls) == 6
    x = torch.randn(1, 4, 5)
    with pytest.raises(ValueError, match="packed sequences"):
        transformers_qwen3_5.causal_conv1d_fn(x, torch.randn(4, 4), seq_idx=torch.zeros(1, 5, dtype=torch.int32))
