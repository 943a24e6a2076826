"""The hand-fused LM-head log-prob op against autograd on the plain float64 formula."""
import pytest
import torch

from asyncrl.training.head_logprobs import linear_logprobs


def reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T) / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def reference_with_entropy(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_values_and_gradients_match_float64_autograd(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    N, H, V = 23, 16, 37  # chunk 5 leaves a short last chunk
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g, dtype=torch.float64)

    up_entropy = torch.randn(N, generator=g, dtype=torch.float64)

    ours, entropy = linear_logprobs(hidden, weight, targets, temperature, chunk, with_entropy=True)
    (ours * upstream + entropy * up_entropy).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref, ref_entropy = reference_with_entropy(hidden, weight, targets, temperature)
    (ref * upstream + ref_entropy * up_entropy).sum().backward()

    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-10, rtol=0)
    torch.testing.assert_close(gh, hidden.grad, atol=1e-10, rtol=1e-10)  # exact gradient of both outputs
    torch.testing.assert_close(gw, weight.grad, atol=1e-10, rtol=1e-10)


def test_float32_matches_float64_and_weight_tied_to_embedding_accumulates():
    """A tied head (the embedding matrix) gets both gradients, as with nn.Linear."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(11, 8)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(11, 8, generator=g))
    ids = torch.randint(0, 11, (6,), generator=g)
    targets = torch.randint(0, 11, (6,), generator=g)
    hidden = torch.tanh(emb(ids))
    linear_logprobs(hidden, emb.weight, targets, 1.0, 4)[0].sum().backward()
    ours = emb.weight.grad.clone()
    emb.weight.grad = None
    reference(torch.tanh(emb(ids)), emb.weight, targets, 1.0).sum().backward()
    torch.testing.assert_close(ours, emb.weight.grad, atol=1e-5, rtol=1e-5)


def test_bfloat16_model_gets_float32_logprobs_close_to_float64():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 32, generator=g).bfloat16()
    weight = torch.randn(50, 32, generator=g).bfloat16()
    targets = torch.randint(0, 50, (10,), generator=g)
    ours, _ = linear_logprobs(hidden, weight, targets, 1.0, 4)
    assert ours.dtype == torch.float32  # log-probs are reported in fp32 whatever the model dtype
    ref = reference(hidden.double(), weight.double(), targets, 1.0)
    torch.testing.assert_close(ours.double(), ref, atol=0.05, rtol=0)  # bf16 matmul output rounding


def test_no_grad_for_weight_when_frozen():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(9, 8)
    linear_logprobs(hidden, weight, torch.tensor([0, 3, 8, 2]), 1.0, 3)[0].sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_logprob_only_loss_gets_the_same_gradient_with_or_without_the_entropy_output():
    """An entropy computed but unused by the loss (a metric) adds nothing to the gradient."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 13, (7,), generator=g)
    grads = []
    for with_entropy in (False, True):
        hidden.grad = None
        linear_logprobs(hidden, weight, targets, 0.9, 3, with_entropy=with_entropy)[0].sum().backward()
        grads.append(hidden.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


def test_entropy_bonus_takes_the_fused_head_with_the_generic_values_and_gradients():
    """response_logprobs on the chunked (big-vocabulary) path, log-prob loss with an entropy
    bonus: the fused head gives the generic checkpointed path's values and gradients."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncrl.training import logprobs as lp_module

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         tie_word_embeddings=True)).double()
    ids = torch.randint(1, 97, (4, 9))
    mask = torch.ones_like(ids)
    saved = lp_module.SMALL_LOGITS_BYTES
    lp_module.SMALL_LOGITS_BYTES = -1  # force the big-vocabulary (chunked) path
    try:
        results = []
        for fused in (False, True):  # generic checkpointed chunks, then the fused head
            model.zero_grad()
            lp, ent = lp_module.response_logprobs(model, ids, mask, 5, 0.8, chunk_tokens=5, with_entropy=True,
                                                  fused_head=fused)
            (lp.sum() - 0.01 * ent.sum()).backward()
            results.append((lp.detach(), ent.detach(), model.lm_head.weight.grad.clone(),
                            model.model.layers[0].mlp.up_proj.weight.grad.clone()))
    finally:
        lp_module.SMALL_LOGITS_BYTES = saved
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
