"""Each prompt once, its cache broadcast to its rows (prompt_cache.py), equals the padded rows
with every prompt repeated: log-probs, entropies and gradients, for a hybrid Qwen3.5 (Gated
DeltaNet conv and recurrent states) as for full attention."""
import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from asyncrl.config import TinyModelConfig  # noqa: E402
from asyncrl.data.char_tokenizer import build_char_tokenizer  # noqa: E402
from asyncrl.training import logprobs as logprobs_mod  # noqa: E402
from asyncrl.training.logprobs import response_logprobs  # noqa: E402
from asyncrl.training.model import build_tiny_model  # noqa: E402


def _model(dtype):
    tok = build_char_tokenizer()
    cfg = TinyModelConfig(architecture="qwen3_5", hidden_size=32, head_dim=8, intermediate_size=64)
    return build_tiny_model(cfg, tok, seed=0).to(dtype), len(tok)


def _batch(vocab, response_length):
    """3 prompts x 3 rows ([9, 9 + response_length]): left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (9, 9 + response_length), generator=gen)
    ids[:, :9] = ids[::3, :9].repeat_interleave(3, 0)
    mask = torch.ones_like(ids)
    mask[:3, :4] = 0
    mask[3:6, :1] = 0
    if response_length > 2:
        mask[1, 11:] = 0
        mask[7, 10:] = 0
    return ids, mask


def _run(model, ids, mask, share):
    model.zero_grad()
    lp, ent = response_logprobs(model, ids, mask, 9, temperature=0.8, with_entropy=True, share_prompts=share)
    real = mask[:, 9:].to(lp.dtype)
    ((lp * real).sum() + 0.1 * (ent * real).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("response_length", [5, 1])
def test_shared_prompts_equal_repeated_prompts_for_a_hybrid_model(dtype, response_length, monkeypatch):
    model, vocab = _model(dtype)
    ids, mask = _batch(vocab, response_length)
    calls = []
    real = logprobs_mod._shared_prefix_states
    monkeypatch.setattr(logprobs_mod, "_shared_prefix_states", lambda *a: calls.append(1) or real(*a))
    shared = _run(model, ids, mask, True)
    assert len(calls) == (response_length > 1)  # one-token responses: padded (transformers' decode path)
    repeated = _run(model, ids, mask, False)
    for got, want in zip(shared[:2], repeated[:2]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, grad in shared[2].items():
        scale = max(1.0, float(repeated[2][name].abs().max()))
        torch.testing.assert_close(grad, repeated[2][name], rtol=0, atol=1e-5 * scale, msg=name)
    assert float(shared[2]["model.layers.0.linear_attn.A_log"].abs().max()) > 0


def test_a_model_without_full_attention_runs_its_prompts_padded():
    """transformers' mask code needs a KV layer in the cache: an all-Gated-DeltaNet model (2
    layers) keeps the repeated-prompt rows, and still trains."""
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(architecture="qwen3_5", hidden_size=32, num_hidden_layers=2, head_dim=8,
                                             intermediate_size=64), tok, seed=0)
    assert "full_attention" not in model.config.layer_types
    ids, mask = _batch(len(tok), 5)
    lp, _ = response_logprobs(model, ids, mask, 9)
    lp.sum().backward()
    assert torch.isfinite(lp).all() and float(model.model.layers[0].linear_attn.A_log.grad.abs().max()) > 0


@pytest.mark.gpu
def test_shared_prompts_equal_repeated_prompts_on_cuda_with_the_fla_kernels(monkeypatch):
    """On CUDA transformers runs FLA's chunked delta rule (with an initial state in the
    continuation) and causal-conv1d where installed: the same equality, bf16 model, fp32 head.
    (The path is off on CUDA until this passes: logprobs.HYBRID_PROMPT_SHARING_ON_CUDA.)"""
    monkeypatch.setattr(logprobs_mod, "HYBRID_PROMPT_SHARING_ON_CUDA", True)
    calls = []
    real = logprobs_mod._shared_prefix_states
    monkeypatch.setattr(logprobs_mod, "_shared_prefix_states", lambda *a: calls.append(1) or real(*a))
    model, vocab = _model(torch.bfloat16)
    model = model.cuda()
    ids, mask = (t.cuda() for t in _batch(vocab, 5))
    shared, repeated = _run(model, ids, mask, True), _run(model, ids, mask, False)
    assert calls == [1]  # the shared path ran
    for got, want in zip(shared[:2], repeated[:2]):
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2)  # bf16 activations, different grouping
    for name, grad in shared[2].items():
        want = repeated[2][name].float()
        assert float((grad.float() - want).norm()) <= 5e-2 * max(float(want.norm()), 1e-3), name
