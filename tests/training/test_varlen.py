"""The varlen layout (GPU default; the dense reference attention on CPU) gives the padded batch's
log-probs, entropies and gradients, and its index arrays are the ones worked out by hand."""
import copy

import pytest
import torch

from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.forward_plan import plan_of, prepare_model
from asyncrl.training.logprobs import position_ids_from_mask, response_logprobs
from asyncrl.training.varlen import varlen_rows, varlen_rows_of_groups


def test_layout_indices_by_hand():
    """Prompt [11, 12] (left-padded to 3) with responses [5, 6, 7] and [8]; prompt [13, 14, 15]
    with response [9, 10]. L = 3.

    tokens:   11 12 | 5 6 | 13 14 15 | 9      (the last response token is never an input; row 1's
    slots:     0  1 | 2 3 |  4  5  6 | 7       only token is predicted by the prompt's last state)
    sequences: prompt 0 (q 0-1, k 0-1); row 0 (q 2-3, k 0 1 2 3); prompt 1 (q 4-6, k 4-6);
               row 2 (q 7, k 4 5 6 7)
    """
    ids = torch.tensor([[0, 11, 12, 5, 6, 7], [0, 11, 12, 8, 0, 0], [13, 14, 15, 9, 10, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    rows = varlen_rows(ids, attn, 3)
    assert rows.input_ids.tolist() == [11, 12, 5, 6, 13, 14, 15, 9]
    assert rows.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rows.cu_q.tolist() == [0, 2, 4, 7, 8] and rows.cu_k.tolist() == [0, 2, 6, 9, 13]
    assert rows.key_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7]
    assert (rows.max_q, rows.max_k) == (3, 4)
    assert rows.state_index.tolist() == [1, 2, 3, 1, 6, 7]  # row 0: prompt end, 5, 6; row 1: prompt end; row 2
    assert rows.token_index.tolist() == [0, 1, 2, 3, 6, 7]
    assert rows.targets.tolist() == [5, 6, 7, 8, 9, 10]


def test_padding_to_a_multiple_adds_one_sequence_of_its_own():
    rows = varlen_rows_of_groups([([1, 2, 3], [[4, 5]])], pad_multiple=8)
    assert rows.tokens == 8 and rows.cu_q.tolist() == [0, 3, 4, 8] and rows.key_index.tolist()[-4:] == [4, 5, 6, 7]


def test_a_response_with_a_hole_is_refused():
    ids = torch.tensor([[1, 2, 3, 4]])
    assert varlen_rows(ids, torch.tensor([[1, 1, 0, 1]]), 2) is None


def _grpo_batch(tok):
    """Two prompts of different lengths, groups of 3 and 2 rows, responses of 0-6 tokens."""
    eos = tok.eos_token_id
    prompts = [tok(p)["input_ids"] for p in ["1+2="] * 3 + ["123+456="] * 2]
    responses = [[5, eos], [6, 7, 8, 9, 9, eos], [], [9, 9, 9, 9, 9], [eos]]
    return pad_prompt_response(prompts, responses, tok.pad_token_id)


def _full_forward(model, ids, attn, plen, temperature):
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    logp = torch.log_softmax(logits.double()[:, plen - 1:-1] / temperature, -1)
    return logp.gather(-1, ids[:, plen:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _values_and_grads(model, fn, mask):
    model.zero_grad()
    lp, ent = fn()
    ((lp + 0.1 * ent) * mask).sum().backward()
    return (lp * mask).double(), (ent * mask).double(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("pad", [1, 16])
def test_varlen_equals_the_full_forward(tiny_policy, pad, monkeypatch):
    model, tok = tiny_policy
    ids, attn, mask, plen = _grpo_batch(tok)
    prepare_model(model, "eager", "varlen")
    assert plan_of(model).layout == "varlen"
    if pad > 1:
        monkeypatch.setattr(type(plan_of(model)), "pad_multiple", property(lambda self: pad))
    varlen = _values_and_grads(model, lambda: response_logprobs(model, ids, attn, plen, 0.8, with_entropy=True), mask)
    full = _values_and_grads(model, lambda: _full_forward(model, ids, attn, plen, 0.8), mask)
    torch.testing.assert_close(varlen[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(varlen[1], full[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(varlen[2], full[2]):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_recomputes_through_the_varlen_attention(tiny_policy):
    """The recomputation in backward runs after the forward restored the model's attention
    implementation: it must still take the varlen path (it took SDPA over the packed tokens and
    torch raised CheckpointError on the H200's FSDP2 step), and the gradients equal the
    un-checkpointed ones."""
    from asyncrl.training.recompute import enable_activation_checkpointing

    model, tok = tiny_policy
    ids, attn, mask, plen = _grpo_batch(tok)
    prepare_model(model, "eager", "varlen")
    model.train()
    run = lambda: response_logprobs(model, ids, attn, plen, 0.8, with_entropy=True)  # noqa: E731
    plain = _values_and_grads(model, run, mask)
    enable_activation_checkpointing(model)
    checkpointed = _values_and_grads(model, run, mask)
    for a, b in zip(plain[2], checkpointed[2]):
        torch.testing.assert_close(a, b)


def test_attention_implementation_is_restored(tiny_policy):
    model, tok = tiny_policy
    ids, attn, _, plen = _grpo_batch(tok)
    prepare_model(model, "eager", "varlen")
    before = model.config._attn_implementation
    with torch.no_grad():
        response_logprobs(model, ids, attn, plen)
    assert model.config._attn_implementation == before


def test_a_deep_copy_keeps_the_plan(tiny_policy):
    """The reference is a deepcopy of the actor's model: it must take the same path."""
    model, _ = tiny_policy
    prepare_model(model, "eager", "varlen")
    assert plan_of(copy.deepcopy(model)).layout == "varlen"


@pytest.mark.gpu
def test_flash_varlen_equals_the_padded_layout_on_gpu():
    """bf16 on CUDA: the probe passes, and FlashAttention's varlen layout gives the padded
    layout's log-probs and gradients to bf16 rounding (uneven rows, two groups)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncrl.training.varlen import probe_flash

    assert probe_flash(torch.device("cuda"), torch.bfloat16) is None
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32)).cuda().bfloat16()
    ids = torch.randint(1, 500, (6, 60), device="cuda")
    ids[3:, :20] = ids[3, :20]
    ids[:3, :20] = ids[0, :20]
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    mask[4, 25:] = 0
    results = []
    for packing in ("padded", "varlen"):
        model = copy.deepcopy(base)
        assert prepare_model(model, "eager", packing).layout == packing
        lp, ent = response_logprobs(model, ids, mask, 20, 0.9, with_entropy=True)
        real = mask[:, 20:].bool()
        ((lp - 0.01 * ent) * real).sum().backward()
        results.append(((lp * real).float(), [p.grad.float() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0.05, rtol=0.05)
    for a, b in zip(results[0][1], results[1][1]):
        assert float((a - b).norm() / b.norm().clamp(min=1e-6)) < 0.05
