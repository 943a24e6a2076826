"""End-to-end engine behaviour vs HF transformers on tiny random checkpoints (CPU, fp32)."""
import pytest
import torch
from conftest import hf_greedy, hf_greedy_loop, make_llm, prompts_for

from asyncrl.types import SamplingParams

ARCHS = ["qwen3", "qwen2", "llama"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch, tiny_dirs, hf_models):
    prompts = prompts_for(1, [3, 9, 17, 6])
    outs = make_llm(tiny_dirs[arch]).generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        c = o.completions[0]
        ref = hf_greedy(hf_models[arch], p, 12)
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref and ref[-1] == 3 else "length")
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_under_preemption_and_chunked_prefill(arch, tiny_dirs, hf_models):
    """14 blocks of 4 tokens for 6 sequences growing to ~30 tokens: the scheduler must
    preempt (recompute) and still give HF's greedy tokens; 5-token prefill budget forces
    chunked prefill too."""
    prompts = prompts_for(2, [10, 12, 7, 15, 9, 11])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(tiny_dirs[arch], num_kv_blocks=14, max_num_batched_tokens=5)
    outs = llm.generate(prompts, params)
    assert llm.metrics["preemptions"] > 0
    hf = hf_models[arch]
    for p, o in zip(prompts, outs):
        assert o.completions[0].token_ids == hf_greedy_loop(hf, p, 16)
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == 14


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (5, 1.0), (-1, 0.8)])
def test_sampling_logprobs_equal_recomputed(arch, top_k, top_p, tiny_dirs, hf_models):
    """The returned log-prob of each sampled token equals the trainer-side recompute
    log_softmax(filter(HF logits / T))[token] (fp32, 1e-4)."""
    T = 0.7
    prompts = prompts_for(3, [5, 11])
    params = SamplingParams(n=3, temperature=T, top_k=top_k, top_p=top_p, max_tokens=10, seed=123,
                            ignore_eos=True)
    outs = make_llm(tiny_dirs[arch]).generate(prompts, params)
    from asyncrl.engine.sampler import _mask_top_k_top_p

    for p, o in zip(prompts, outs):
        assert len(o.completions) == 3
        for c in o.completions:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logits = hf_models[arch](ids).logits[0, len(p) - 1:-1].float() / T
            n = logits.shape[0]
            logits = _mask_top_k_top_p(logits, torch.full((n,), top_k), torch.full((n,), top_p))
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert torch.isfinite(ref).all()  # every sampled token lies inside the support
            assert (torch.tensor(c.logprobs) - ref).abs().max().item() <= 1e-4


def test_seeded_sampling_independent_of_batch(tiny_dirs):
    """A seeded request yields the same tokens alone and in a crowd of other requests
    under a KV budget tight enough to force preemption (recompute)."""
    target = prompts_for(4, [8])[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    alone = make_llm(tiny_dirs["llama"]).generate([target], params)[0]
    others = prompts_for(5, [3, 13, 6])
    other_params = SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(tiny_dirs["llama"], num_kv_blocks=24)
    mixed = llm.generate(others[:2] + [target] + others[2:], [other_params] * 2 + [params, other_params])[2]
    assert llm.metrics["preemptions"] > 0
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in mixed.completions]
    assert len({tuple(c.token_ids) for c in alone.completions}) > 1  # samples differ from each other


def test_prefix_sharing_prefills_prompt_once(tiny_dirs):
    """n=8 with a 10-token prompt (block 4): the prompt is prefilled once; the 7 siblings
    share its 2 full blocks and copy only the partial third; refs return to zero."""
    llm = make_llm(tiny_dirs["qwen3"], num_kv_blocks=64)
    prompt = prompts_for(6, [10])[0]
    free0 = llm.block_manager.num_free_blocks
    rid = llm.add_request(prompt, SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=0, ignore_eos=True))
    llm.step()  # prefill + fork
    parent = llm._requests[rid]
    assert len(parent.group) == 8
    tables = [s.block_table for s in parent.group]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full prompt blocks shared
    assert len({t[2] for t in tables}) == 8  # partial block private
    assert llm.block_manager.blocks[tables[0][0]].ref_count == 8
    assert free0 - llm.block_manager.num_free_blocks == 2 + 8  # 2 shared + 8 partial
    assert llm.metrics["prefill_tokens"] == 10
    while llm.has_unfinished():
        llm.step()
    out = llm._collect(rid)
    assert len(out.completions) == 8 and all(len(c.token_ids) == 6 for c in out.completions)
    llm.block_manager.check_invariants([])
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)


def test_fork_off_prefills_each_sample(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"], num_kv_blocks=64, enable_fork=False, enable_prefix_caching=False)
    llm.generate([prompts_for(6, [10])[0]], SamplingParams(n=8, max_tokens=2, ignore_eos=True))
    assert llm.metrics["prefill_tokens"] == 80


def test_forked_samples_equal_unforked(tiny_dirs):
    """Sharing is an optimisation only: with the same seed, fork on/off give equal tokens."""
    prompt = prompts_for(9, [10])[0]
    params = SamplingParams(n=5, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    a = make_llm(tiny_dirs["qwen2"]).generate([prompt], params)[0]
    b = make_llm(tiny_dirs["qwen2"], enable_fork=False, enable_prefix_caching=False).generate([prompt], params)[0]
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    for ca, cb in zip(a.completions, b.completions):
        assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4


def test_prefix_cache_hit_and_version_namespace(tiny_dirs, hf_models):
    llm = make_llm(tiny_dirs["llama"])
    prompt = prompts_for(7, [13])[0]
    first = llm.generate([prompt], GREEDY)[0].completions[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].completions[0].token_ids == first
    assert llm.metrics["prefix_cache_hit_tokens"] == 12  # 3 full blocks reused
    llm.update_weights(hf_models["llama"].state_dict().items(), version=1)
    out = llm.generate([prompt], GREEDY)[0].completions[0]
    assert llm.metrics["prefix_cache_hit_tokens"] == 12  # stale K/V not reused
    assert out.token_ids == first and set(out.versions) == {1}


@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_filled_by_decode_are_cached(tiny_dirs, overlap):
    """Blocks that decode steps fill are hashed as they fill: a prompt of 6 tokens (block 4) and 10
    new ones leave K/V for 15 tokens, so a second request whose prompt is the first 13 tokens of the
    result hits 3 full blocks, 2 of them filled by decode (a first block from the prefill alone)."""
    llm = make_llm(tiny_dirs["qwen3"], async_scheduling=overlap)
    prompt = prompts_for(9, [6])[0]
    done = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    full = prompt + done[0].completions[0].token_ids
    before = llm.metrics["prefix_cache_hit_tokens"]
    llm.generate([full[:13]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert llm.metrics["prefix_cache_hit_tokens"] - before == 12
    llm.block_manager.check_invariants([])


def test_update_weights_changes_policy(tiny_dirs, hf_models):
    """Push scaled weights under HF names: generations follow HF on the new weights."""
    hf = hf_models["llama"]
    llm = make_llm(tiny_dirs["llama"])
    new = {k: (v * 1.3 if v.dim() == 2 else v) for k, v in hf.state_dict().items()}
    llm.update_weights(new.items(), version=5)
    import copy

    hf2 = copy.deepcopy(hf)
    hf2.load_state_dict(new)
    prompt = prompts_for(8, [7])[0]
    out = llm.generate([prompt], GREEDY)[0].completions[0]
    assert out.token_ids == hf_greedy(hf2, prompt, 12)
    assert set(out.versions) == {5}


def test_stop_tokens_max_tokens_abort_pause(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"])
    prompt = prompts_for(10, [6])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].completions[0]
    stop_tok = free.token_ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0].completions[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(stop_tok) + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    # abort mid-flight: partial tokens kept, blocks freed, all n completions returned
    rid = llm.add_request(prompt, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        llm.step()
    llm.abort([rid])
    assert not llm.has_unfinished()
    res = llm._collect(rid)
    assert [c.finish_reason for c in res.completions] == ["abort"] * 3
    assert all(len(c.token_ids) == 3 for c in res.completions)  # prefill + 2 decode steps
    llm.block_manager.check_invariants([])
    # pause blocks stepping from another thread until resume
    import threading

    llm.pause()
    done = threading.Event()
    t = threading.Thread(target=lambda: (llm.generate([prompt], GREEDY), done.set()))
    t.start()
    assert not done.wait(0.3)
    llm.resume()
    assert done.wait(30)
    t.join()


def test_oversized_request_is_rejected_not_hung(tiny_dirs):
    llm = make_llm(tiny_dirs["qwen3"], num_kv_blocks=4)
    with pytest.raises(ValueError):
        llm.generate([prompts_for(11, [10])[0]], SamplingParams(max_tokens=20))


class _CharTokenizer:
    """Token t <-> chr(ord('a') + t % 26): enough to exercise stop strings."""

    eos_token_id = 3

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") + 4 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_and_text(tiny_dirs):
    from asyncrl.engine import LLM

    llm = LLM(tiny_dirs["llama"], dtype=torch.float32, device="cpu", tokenizer=_CharTokenizer(), block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    free = llm.generate("hello", params)[0]
    assert free.prompt == "hello" and free.prompt_token_ids == _CharTokenizer().encode("hello")
    text = free.completions[0].text
    stop = text[4:6]
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                 stop=[stop]))[0].completions[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert llm.generate([], params) == []


def test_weight_update_mid_generation_tags_versions(tiny_dirs, hf_models):
    """Async RL: pause a generate running in another thread, push new weights, resume.
    Tokens before the push carry version 0, after it version 1 (a single switch)."""
    import threading
    import time

    llm = make_llm(tiny_dirs["llama"])
    prompt = prompts_for(13, [5])[0]
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", llm.generate(
        [prompt], SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1, ignore_eos=True))))
    t.start()
    deadline = time.monotonic() + 30
    while llm.num_steps < 5 and time.monotonic() < deadline:  # let it run a few steps
        time.sleep(0.001)
    llm.pause()
    llm.update_weights(hf_models["llama"].state_dict().items(), version=1)
    llm.resume()
    t.join(60)
    for c in result["out"][0].completions:
        v = c.versions
        assert len(v) == 40 and v[0] == 0 and v[-1] == 1 and v == sorted(v)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_weight_update_kv_keep_or_recompute(kv, tiny_dirs, hf_models):
    """Greedy, weights changed after 5 tokens. "recompute" drops the old-weight K/V, so the
    continuation is exactly what the new model generates from prompt + those 5 tokens;
    "keep" attends to K/V of the old weights and (on this prompt) continues differently.
    Blocks are all returned either way; tokens before the update keep version 0."""
    import copy

    hf = hf_models["llama"]
    g = torch.Generator().manual_seed(0)
    new = {k: (v + 0.2 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v) for k, v in hf.state_dict().items()}
    hf_new = copy.deepcopy(hf)
    hf_new.load_state_dict(new)
    llm = make_llm(tiny_dirs["llama"])
    prompts = prompts_for(21, [9, 6, 7, 10])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    for _ in range(5):  # one prefill step + 4 decode steps: 5 tokens each
        llm.step()
    llm.update_weights(new.items(), version=1, kv=kv)
    while llm.has_unfinished():
        llm.step()
    outs = [llm._collect(r).completions[0] for r in ids]
    assert llm.block_manager.num_free_blocks == len(llm.block_manager.blocks)
    same = []
    for prompt, out in zip(prompts, outs):
        assert out.versions == [0] * 5 + [1] * 7
        assert out.token_ids[:5] == hf_greedy_loop(hf, prompt, 5)
        same.append(out.token_ids[5:] == hf_greedy_loop(hf_new, prompt + out.token_ids[:5], 7))
    assert all(same) if kv == "recompute" else not all(same)
    with pytest.raises(ValueError):
        llm.update_weights(new.items(), version=2, kv="flush")


def test_generate_returns_when_another_caller_took_its_finish(tiny_dirs):
    """Two threads step one engine (the async weight sync's probe next to the rollout): a step
    returns each finish to ITS caller only. Here every step of the short call is preceded by a
    rival's step that takes all finishes; the call must still return right after its own
    request finishes, not when the engine runs empty (the long request: 200 more steps)."""
    llm = make_llm(tiny_dirs["qwen3"])
    long_id = llm.add_request(prompts_for(30, [6])[0], SamplingParams(max_tokens=200, ignore_eos=True))
    step = llm.step
    llm.step = lambda: (step(), [])[1]  # the rival ran this step: its finishes are gone
    start = llm.num_steps
    out = llm.generate([prompts_for(31, [5])[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.completions[0].token_ids) == 3
    assert llm.num_steps - start <= 5 and not llm.request_finished(long_id)


def test_fast_batch_decoder_equals_decode(tmp_path):
    """The batched backend decode is used only where it gives ``tokenizer.decode``'s text:
    a word-level tokenizer with special tokens (skipped), empty and ragged rows."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from asyncrl.engine.llm import BATCH_DECODE_MIN_TOKENS, fast_batch_decoder

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(50)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", eos_token=AddedToken("t49", single_word=True),
                            clean_up_tokenization_spaces=False).save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    decode = fast_batch_decoder(tok)
    assert decode is not None
    rows = [[5, 6, 49, 7], [], [1] * 9, [49]]
    assert decode(rows) == [tok.decode(r, skip_special_tokens=True) for r in rows]  # one by one
    big = rows + [[i % 50 for i in range(BATCH_DECODE_MIN_TOKENS)]]  # the backend's decode_batch
    assert decode(big) == [tok.decode(r, skip_special_tokens=True) for r in big]
    tok.clean_up_tokenization_spaces = True  # a pass the backend does not do: no fast path
    assert fast_batch_decoder(tok) is None and fast_batch_decoder(object()) is None
