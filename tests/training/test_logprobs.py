"""Chunked log-probs / entropy equal the unchunked computation, values and gradients, in the
padded layout and in the packed one (``pack_bin_tokens`` 0: padded; see tests/training/test_packing.py)."""
import pytest
import torch

from asyncrl.training import logprobs as logprobs_module
from asyncrl.training.logprobs import response_logprobs

LAYOUTS = [0, 128]  # pack_bin_tokens: padded layout, packed layout


@pytest.fixture
def always_chunk(monkeypatch):
    """Small logits are computed in one plain pass; force the chunked, checkpointed head."""
    monkeypatch.setattr(logprobs_module, "SMALL_LOGITS_BYTES", -1)


def _batch(tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "123+456=", "7+7="]]
    responses = [[5, 6, tokenizer.eos_token_id], [7, 8, 9, 10], [tokenizer.eos_token_id]]
    from asyncrl.training.batch import pad_prompt_response
    return pad_prompt_response(prompts, responses, tokenizer.pad_token_id)


def _reference(model, input_ids, attention_mask, prompt_len, temperature):
    """Plain full-logits computation in float64."""
    from asyncrl.training.logprobs import position_ids_from_mask
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask)).logits.double() / temperature
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1], -1)
    target = input_ids[:, prompt_len:]
    lp = logp.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def assert_same_results(first, second, tol: float) -> None:
    """Two (log-probs, entropies, parameter gradients) results agree: values within ``tol``,
    gradients within ``tol`` absolute and ``10 * tol`` relative."""
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = first, second
    torch.testing.assert_close(lp_a, lp_b, atol=tol, rtol=tol)
    torch.testing.assert_close(ent_a, ent_b, atol=tol, rtol=tol)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=tol, rtol=10 * tol)

@pytest.mark.parametrize("pack", LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 3, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked(tiny_policy, always_chunk, chunk, temperature, pack):
    model, tok = tiny_policy
    input_ids, attention_mask, _, prompt_len = _batch(tok)
    real = attention_mask[:, prompt_len:].bool()  # positions past a response are the callers' to mask
    with torch.no_grad():
        lp, ent = response_logprobs(model, input_ids, attention_mask, prompt_len, temperature, chunk,
                                    with_entropy=True, pack_bin_tokens=pack)
        ref_lp, ref_ent = _reference(model, input_ids, attention_mask, prompt_len, temperature)
    torch.testing.assert_close(lp.double()[real], ref_lp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double()[real], ref_ent[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", LAYOUTS)
def test_small_logits_skip_chunking_with_the_same_values(tiny_policy, pack):
    model, tok = tiny_policy
    input_ids, attention_mask, mask, prompt_len = _batch(tok)
    results = []
    for threshold in (-1, logprobs_module.SMALL_LOGITS_BYTES):  # chunked + checkpointed, then one plain pass
        logprobs_module.SMALL_LOGITS_BYTES, saved = threshold, logprobs_module.SMALL_LOGITS_BYTES
        try:
            model.zero_grad()
            lp, ent = response_logprobs(model, input_ids, attention_mask, prompt_len, 0.9, 2, with_entropy=True,
                                        pack_bin_tokens=pack)
            ((lp + 0.1 * ent) * mask).sum().backward()
        finally:
            logprobs_module.SMALL_LOGITS_BYTES = saved
        results.append((lp * mask, ent * mask, [p.grad.clone() for p in model.parameters()]))
    assert_same_results(*results, tol=1e-6)


@pytest.mark.parametrize("pack", LAYOUTS)
def test_chunked_gradients_equal_unchunked(tiny_policy, always_chunk, pack):
    model, tok = tiny_policy
    input_ids, attention_mask, mask, prompt_len = _batch(tok)
    grads = []
    for chunk in (2, 4096):
        model.zero_grad()
        lp, ent = response_logprobs(model, input_ids, attention_mask, prompt_len, 1.0, chunk, with_entropy=True,
                                    pack_bin_tokens=pack)
        ((lp + 0.1 * ent) * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pack", LAYOUTS)
def test_left_padding_does_not_change_logprobs(tiny_policy, pack):
    model, tok = tiny_policy
    from asyncrl.training.batch import pad_prompt_response
    prompt, response = tok("12+3=")["input_ids"], [5, 6, tok.eos_token_id]
    alone = pad_prompt_response([prompt], [response], tok.pad_token_id)
    padded = pad_prompt_response([prompt, tok("123+456=")["input_ids"]], [response, [5]], tok.pad_token_id)
    with torch.no_grad():
        lp_alone, _ = response_logprobs(model, alone[0], alone[1], alone[3], pack_bin_tokens=pack)
        lp_padded, _ = response_logprobs(model, padded[0], padded[1], padded[3], pack_bin_tokens=pack)
    torch.testing.assert_close(lp_alone[0], lp_padded[0, :3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", LAYOUTS)
def test_shared_prompt_forward_equals_per_row_forward(tiny_policy, pack):
    """Rows sharing a prompt run it once (KV broadcast, or packed after it); values and gradients
    are unchanged."""
    from asyncrl.training.batch import pad_prompt_response
    model, tok = tiny_policy
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "1+2=", "1+2=", "123+456=", "123+456="]]
    responses = [[5, tok.eos_token_id], [6, 7, 8], [tok.eos_token_id], [9, 9, 9, 9], [5]]
    input_ids, attention_mask, mask, prompt_len = pad_prompt_response(prompts, responses, tok.pad_token_id)
    results = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            lp, ent = response_logprobs(model, input_ids, attention_mask, prompt_len, 0.8, 3, with_entropy=True,
                                        pack_bin_tokens=pack)
        else:  # one row at a time: no two rows in a call share a prompt
            rows = [response_logprobs(model, input_ids[i:i + 1], attention_mask[i:i + 1], prompt_len, 0.8, 3,
                                      with_entropy=True, pack_bin_tokens=0) for i in range(5)]
            lp, ent = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        ((lp + 0.1 * ent) * mask).sum().backward()
        results.append((lp * mask, ent * mask, [p.grad.clone() for p in model.parameters()]))
    assert_same_results(*results, tol=1e-5)
