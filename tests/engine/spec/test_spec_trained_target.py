"""bench/spec_trained_target.py (issue 23's trained-target speculation row) at CPU size: the GPU
command's code path, every row, on tiny shapes; and its text helpers (bench/text_lm.py)."""
from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import build_tiny, make_llm

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("spec_trained_target")  # puts bench/ on sys.path for its text_lm import
text_lm = _load("text_lm")


def test_the_tokenizer_round_trips_gsm8k_and_ends_each_document_with_eos():
    rows = text_lm.gsm8k_rows(0, 60)
    docs = [text_lm.document(r) for r in rows]
    tok = text_lm.train_tokenizer(docs, 300)
    assert tok.get_vocab_size() == 300
    held_out = text_lm.document(text_lm.gsm8k_rows(1, 1)[0])
    assert tok.decode(tok.encode(held_out).ids) == held_out  # byte-level: unseen text round-trips
    stream = text_lm.token_stream(tok, docs[:5])
    ends = (stream == 0).nonzero().flatten().tolist()
    assert len(ends) == 5 and ends[-1] == len(stream) - 1
    assert tok.decode(stream[:ends[0]].tolist()) == docs[0]
    chunks = text_lm.chunk(stream, 16)
    assert chunks.shape == (len(stream) // 16, 16) and chunks[1].tolist() == stream[16:32].tolist()


def test_lm_loss_is_the_mean_next_token_cross_entropy():
    model = text_lm.new_lm(dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8), 64, "cpu")
    x = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = model(input_ids=x).logits.double().log_softmax(-1)  # [3, 10, 50]
        want = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean()  # position p predicts token p + 1
        assert abs(float(text_lm.lm_loss(model, x)) - float(want)) < 1e-5


def test_repetition_measures():
    assert text_lm.distinct_ngrams([[1, 2, 3, 4, 5, 6]]) == 1.0
    assert text_lm.distinct_ngrams([[1, 2] * 10]) == round(2 / 17, 4)  # 17 4-grams, 2 distinct
    assert text_lm.distinct_ngrams([[1, 2, 3, 4, 5], [7] * 5]) == round((1.0 + 0.5) / 2, 4)
    assert text_lm.longest_repeat_suffix([[5, 6, 7] * 100]) == 1.0
    noise = list(range(300))
    random.Random(0).shuffle(noise)
    assert text_lm.longest_repeat_suffix([noise]) < 0.05  # no token repeats: no period fits
    loop_after_noise = noise[:200] + [1, 2, 3, 4] * 64
    assert text_lm.longest_repeat_suffix([loop_after_noise]) == 1.0  # only the last 256 count


def test_the_bench_runs_every_row_on_a_tiny_trained_target(tmp_path):
    out = tmp_path / "r.json"
    r = bench.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    t = r["target"]
    assert t["steps"] == bench.TINY["target_steps"] and t["loss_last"] < t["loss_first"] - 0.3
    assert t["heldout_loss"] < math.log(bench.TINY["vocab"])  # learnt something about unseen GSM8K text
    assert r["draft_model"]["distilled"]["steps"] == bench.TINY["draft_kd_steps"]
    assert r["eagle"]["steps"] == bench.TINY["head_steps"]
    assert list(r["rows"]) == list(bench.ROWS) + ["off_again"]  # off first and last: the reference
    assert r["rows"]["off_again"]["greedy"]["same_tokens_as_off"]
    n = bench.TINY["tail_batch"] * bench.TINY["tail_tokens"]
    for name in bench.ADAPTIVE:  # the tails with the speed gate: exact tokens, its record, no workload (a)
        row = r["rows"][name]
        assert "a" not in row and row["greedy"]["same_tokens_as_off"], name
        for key in ("greedy", "t1"):
            g = row[key]
            assert g["tokens"] == n and g["spec_steps"] > 0  # reset after the warm-up: it starts speculating
            assert g["gate_plain_steps"] >= 0 and g["gate_buckets"] and r["summary"][f"{name}/{key}"] == g["x_off"]
            assert all(set(e) == {"spec", "plain", "speculating"} for e in g["gate_buckets"].values())
        assert f"{name}/t1 >= 0.95x off (adaptive: no slower than off where drafts do not pay)" in r["bars"]
    for name in ("off", *bench.DRAFTERS):  # every step they may, the drafters' rows speculate
        row = r["rows"][name]
        for key in ("greedy", "t1"):
            assert row[key]["tokens"] == n
            assert 0.0 <= row[key]["distinct_4gram"] <= 1.0 and 0.0 <= row[key]["loop_share_last_256"] <= 1.0
        # fp32: every drafter's greedy tokens are speculation off's; n-gram drafts are one-hot, so its
        # sampled tokens are too (the probabilistic drafters' follow the target's law instead)
        assert row["greedy"]["same_tokens_as_off"], name
        if name == "ngram":
            assert row["t1"]["same_tokens_as_off"]
        if name == "off":
            continue
        g = row["greedy"]
        assert g["rounds"] > 0 and 0 <= g["accepted"] <= g["drafted"] and 0.0 <= g["acceptance_rate"] <= 1.0
        assert g["tokens_per_target_pass"] == round((g["rounds"] + g["accepted"]) / g["rounds"], 3)
        assert row["a"]["rounds"] == 0  # batch 3 is above the threshold of 2: speculation stays off
        assert r["summary"][f"{name}/greedy"] == g["x_off"]
    for name in ("draft_model", "eagle"):  # the probabilistic drafters did draft on the sampled tails
        assert r["rows"][name]["t1"]["drafted"] > 0


# -- a draft model of its own shape (the bench's: narrower, shallower, fewer heads than the target) --

def _narrow_draft():
    """A 1-layer, width-32, 2-head draft of the tiny target's vocabulary (head_dim 16 as the target's):
    a K/V pool of another geometry than the target's. Untrained: its tied embeddings make it draft
    the last token again, which the tiny target often emits, so drafts are accepted and rejected."""
    return text_lm.new_lm(dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
                          max_pos=512, device="cpu", seed=3)


def _narrow_draft_equals_off(target_dir, llm_of):
    """Greedy and sampled tokens with the narrow draft equal speculation off; some drafts are
    accepted and some rejected (both paths of the draft's K/V bookkeeping run)."""
    from asyncrl.types import SamplingParams

    spec = {"method": "draft_model", "model": _narrow_draft(), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [40, 12, 77, 3, 19, 60]]
    for params in (SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_tokens=32, seed=2, ignore_eos=True, n=2)):
        off = llm_of(target_dir).generate(prompts, params)
        llm = llm_of(target_dir, speculative_config=spec)
        on = llm.generate(prompts, params)
        assert [c.token_ids for o in on for c in o.outputs] == [c.token_ids for o in off for c in o.outputs]
        assert 0.1 < llm.metrics["spec_acceptance_rate"] < 0.95, llm.metrics["spec_acceptance_rate"]
    return llm


def test_a_draft_model_of_another_shape_gives_the_same_tokens(tmp_path):
    _narrow_draft_equals_off(build_tiny("qwen3", tmp_path), make_llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_draft_model_of_another_shape_gives_the_same_tokens(tmp_path):
    """The same on CUDA (fp32), the draft's round in its CUDA graphs (paged kernel on the draft's pool)."""
    from asyncrl.engine import LLM

    def cuda_llm(path, **kw):
        return LLM(path, dtype=torch.float32, device="cuda", block_size=16, max_model_len=256,
                   gpu_memory_utilization=0.3, **kw)

    llm = _narrow_draft_equals_off(build_tiny("qwen3", tmp_path), cuda_llm)
    assert llm.spec.proposer.graphs  # the rounds ran through the captured graphs
