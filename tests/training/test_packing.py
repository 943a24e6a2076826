"""The packed layout gives the padded batch's log-probs, entropies and gradients, token for token."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.logprobs import position_ids_from_mask, response_logprobs
from asyncrl.training.packing import pack_rows, prefix_nodes, response_lengths


def _grpo_batch(tok):
    """Three prompts (two of 3 rows, one alone), responses of 0-5 tokens, padded as the trainer pads."""
    eos = tok.eos_token_id
    prompts = [tok(p)["input_ids"] for p in ["1+2="] * 3 + ["123+456="] * 3 + ["7+7="]]
    responses = [[5, eos], [6, 7, 8, eos], [eos], [9, 9, 9, 9, 9], [], [5, 6], [8, 8, eos]]
    return pad_prompt_response(prompts, responses, tok.pad_token_id)


def _shared_prefix_batch(tok):
    """GRPO-like rows whose responses repeat each other: equal answers, a shared first token,
    an empty response and one that is its sibling's prefix."""
    eos = tok.eos_token_id
    prompts = [tok(p)["input_ids"] for p in ["1+2="] * 5 + ["45+6="] * 4]
    responses = [[5, 6, eos], [5, 6, eos], [5, 7, eos], [8, eos], [5, 6, eos],
                 [9, 9, 9, 9, 9], [9, 9, eos], [], [9, 9, 9, eos]]
    return pad_prompt_response(prompts, responses, tok.pad_token_id)


def _full_forward(model, input_ids, attention_mask, prompt_len, temperature):
    """The straightforward computation: every row in full, all logits, float64 log-softmax."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits.double() / temperature
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1], -1)
    lp = logp.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _values_and_grads(model, fn, mask):
    model.zero_grad()
    lp, ent = fn()
    ((lp + 0.1 * ent) * mask).sum().backward()
    return (lp * mask).double(), (ent * mask).double(), [p.grad.clone() for p in model.parameters()]


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)
    for x, y in zip(a[2], b[2]):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bin_tokens, bins", [(14, 3), (23, 2), (128, 1)])  # groups of 9, 14 and 7 tokens
def test_packed_equals_the_full_forward(tiny_policy, bin_tokens, bins):
    model, tok = tiny_policy
    ids, attn, mask, plen = _grpo_batch(tok)
    assert pack_rows(ids, attn, plen, bin_tokens).input_ids.shape[0] == bins
    packed = _values_and_grads(model, lambda: response_logprobs(model, ids, attn, plen, 0.8, with_entropy=True,
                                                                pack_bin_tokens=bin_tokens), mask)
    full = _values_and_grads(model, lambda: _full_forward(model, ids, attn, plen, 0.8), mask)
    _assert_same(packed, full)


def _rms_norm_in_input_dtype(self, hidden_states):
    """Qwen3RMSNorm without its float32 round trip, so a float64 model is float64 throughout."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("bin_tokens, bins", [(16, 2), (128, 1)])  # groups of 5 + 4 and 6 + 4 tokens (14, 15 unshared)
def test_shared_response_prefixes_equal_the_full_forward_in_float64(tiny_checkpoint, tiny_policy, monkeypatch,
                                                                     share, bin_tokens, bins):
    """Rows that share a response prefix read one set of states: in float64 (the RMSNorm's float32
    round trip patched out, which would round each row's gradient apart) the log-probs, entropies
    and gradients are the full forward's to float64 rounding: the math is the same."""
    from transformers.models.qwen3 import modeling_qwen3

    from asyncrl.training import packing
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_in_input_dtype)
    monkeypatch.setattr(packing, "SHARE_RESPONSE_PREFIXES", share)
    _, tok = tiny_policy
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint)).double()
    ids, attn, mask, plen = _shared_prefix_batch(tok)
    packed_rows = pack_rows(ids, attn, plen, bin_tokens)
    assert packed_rows.input_ids.shape[0] == bins
    # prompts + tree nodes; one node per row and input without sharing
    assert (packed_rows.input_ids != tok.pad_token_id).sum() == (5 + 4 + 6 + 4 if share else 5 + 9 + 6 + 9)
    packed = _values_and_grads(model, lambda: response_logprobs(model, ids, attn, plen, 0.8, with_entropy=True,
                                                                pack_bin_tokens=bin_tokens), mask)
    full = _values_and_grads(model, lambda: _full_forward(model, ids, attn, plen, 0.8), mask)
    torch.testing.assert_close(packed[0], full[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(packed[1], full[1], atol=1e-12, rtol=1e-10)
    for x, y in zip(packed[2], full[2]):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("make_batch", [_grpo_batch, _shared_prefix_batch])
def test_packed_equals_the_full_forward_with_eager_attention(tiny_checkpoint, tiny_policy, make_batch):
    _, tok = tiny_policy
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    ids, attn, mask, plen = make_batch(tok)
    assert pack_rows(ids, attn, plen, 40) is not None
    packed = _values_and_grads(model, lambda: response_logprobs(model, ids, attn, plen, 1.0, with_entropy=True,
                                                                pack_bin_tokens=40), mask)
    full = _values_and_grads(model, lambda: _full_forward(model, ids, attn, plen, 1.0), mask)
    _assert_same(packed, full)


def test_positions_past_a_response_are_zero_in_the_packed_layout(tiny_policy):
    model, tok = tiny_policy
    ids, attn, mask, plen = _grpo_batch(tok)
    with torch.no_grad():
        lp, ent = response_logprobs(model, ids, attn, plen, with_entropy=True, pack_bin_tokens=128)
    real = attn[:, plen:].bool()
    assert (lp[~real] == 0).all() and (ent[~real] == 0).all()
    assert (lp[real] < 0).all() and (ent[real] > 0).all()


def test_layout_of_one_prompt_with_two_responses():
    """Prompt [1, 2] (left-padded by one), responses [a, b, eos] and [c, eos]: the bin holds the
    prompt once and each response without its last token; each token's state is where it belongs."""
    pad, eos, a, b, c = 0, 2, 5, 6, 7
    ids = torch.tensor([[pad, 1, 2, a, b, eos], [pad, 1, 2, c, eos, pad]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    packed = pack_rows(ids, attn, 3, 16)
    assert packed.input_ids.tolist() == [[1, 2, a, b, c]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    # row 0: a <- state of "2" (1), b <- a (2), eos <- b (3); row 1: c <- "2" (1), eos <- c (4)
    assert packed.state_index.tolist() == [1, 2, 3, 1, 4]
    assert packed.token_index.tolist() == [0, 1, 2, 3, 4]  # [B * L] with L = 3
    assert packed.targets.tolist() == [a, b, eos, c, eos]
    visible = packed.attention[0, 0].int().tolist()
    assert visible == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 0],
                       [1, 1, 0, 0, 1]]  # c sees the prompt and itself, not the other response


def test_layout_shares_response_prefixes():
    """Prompt [1, 2], responses [a, b, eos], [a, c, eos], [a, b, eos]: the tree holds a, ab and ac
    once; c sees the prompt, a and itself (not b); the third row reads the first row's states."""
    eos, a, b, c = 2, 5, 6, 7
    ids = torch.tensor([[1, 2, a, b, eos], [1, 2, a, c, eos], [1, 2, a, b, eos]])
    packed = pack_rows(ids, torch.ones_like(ids), 2, 16)
    assert packed.input_ids.tolist() == [[1, 2, a, b, c]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 3]]
    assert packed.state_index.tolist() == [1, 2, 3, 1, 2, 4, 1, 2, 3]
    assert packed.token_index.tolist() == list(range(9))
    assert packed.targets.tolist() == [a, b, eos, a, c, eos, a, b, eos]
    visible = packed.attention[0, 0].int().tolist()
    assert visible == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 0],
                       [1, 1, 1, 0, 1]]


def test_prefix_nodes_with_and_without_sharing():
    responses = [[5, 6, 2], [5, 6, 2], [5, 7, 2], [2], []]
    assert prefix_nodes(responses) == {(0, 5): 0, (0, 5, 6): 1, (0, 5, 7): 2}
    assert list(prefix_nodes(responses, share=False)) == [(0, 5), (0, 5, 6), (1, 5), (1, 5, 6), (2, 5), (2, 5, 7)]


def test_layout_is_refused_for_long_groups_and_holed_responses():
    ids = torch.tensor([[1, 2, 5, 6, 7]])
    assert pack_rows(ids, torch.ones_like(ids), 2, 4) is not None  # 2 prompt + 2 inputs = 4 fits
    assert pack_rows(ids, torch.ones_like(ids), 2, 3) is None
    holed = torch.tensor([[1, 1, 1, 0, 1]])
    assert response_lengths(holed, 2) is None
    assert pack_rows(ids, holed, 2, 64) is None


@pytest.mark.parametrize("make_batch", [_grpo_batch, _shared_prefix_batch])
@pytest.mark.parametrize("overrides", [
    ["algorithm.decoupled=false", "algorithm.rollout_correction.level=none"],  # PPO clip, token-mean
    ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token", "algorithm.entropy_coeff=0.01"],
    ["actor.micro_batch_size=3", "actor.mini_batches=2"],  # micro-batches split the groups
])
def test_actor_update_is_the_same_in_both_layouts(tiny_policy, monkeypatch, overrides, make_batch):
    """One optimizer step from the same weights: the same loss, gradients and metrics."""
    import copy

    from asyncrl.config import load_config
    from asyncrl.training import logprobs
    from asyncrl.training.actor import Actor
    from asyncrl.types import TrainBatch
    model, tok = tiny_policy
    ids, attn, mask, plen = make_batch(tok)
    size, length = mask.shape
    gen = torch.Generator().manual_seed(0)
    cfg = load_config(None, overrides)
    results = []
    for bin_tokens in (0, 128):
        monkeypatch.setattr(logprobs, "PACK_BIN_TOKENS", bin_tokens)
        batch = TrainBatch(input_ids=ids, attention_mask=attn, response_mask=mask, prompt_length=plen,
                           rollout_logprobs=-torch.rand(size, length, generator=gen) * mask,
                           token_versions=torch.zeros(size, length, dtype=torch.long),
                           scores=torch.zeros(size), group_ids=torch.zeros(size, dtype=torch.long),
                           advantages=torch.randn(size, 1, generator=gen).expand(size, length) * mask)
        gen.manual_seed(0)  # the same batch both times
        actor = Actor(copy.deepcopy(model), cfg.actor, cfg.algorithm, temperature=1.0)
        metrics = actor.update(batch)
        results.append((metrics, [p.grad.clone() for p in actor.model.parameters()]))
    (m_a, g_a), (m_b, g_b) = results
    assert m_a.keys() == m_b.keys()
    for key in m_a.keys() - {"actor/tflops", "actor/mfu"}:  # throughput: timing, not numbers
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
