"""Speculative decoding on a target with real structure (issue 23's draft-model row), in one run.

A random-weight target has no cheap draft (bench/RESULTS.md, issue 23: a trained EAGLE head only
drafted well as the copy rule), so this bench first gives the target structure, then drafts for it:

  1. tokenizer: a byte-level BPE (``--vocab`` tokens, default 8,192) trained on GSM8K's training text
     (bench/text_lm.py; GSM8K ships inside the package, nothing to carry). The target keeps the
     Qwen3-0.6B shape, its 151,936-row embedding / LM head included: ids past the tokenizer's are
     never seen in training (their logits are pushed down) but the target costs what a real 0.6B
     costs per step, LM head included; ``--model-vocab tokenizer`` shrinks it to the tokenizer's size.
  2. target: that shape from random init, trained on GSM8K training documents (``--target-seconds``,
     chunks of ``--seq-len`` tokens: as long as the timed tails, so positions up to 2,048 new tokens
     were trained); its held-out loss on GSM8K test documents is reported.
  3. the target's own samples: continuations of ``--head-prompts`` GSM8K training questions (half
     greedy, half at temperature 1, ``--head-len`` tokens) through train-draft's ``policy_samples``.
  4. drafts: (a) ``draft_model``: a small Qwen3 of the same tokenizer (``DRAFT_SHAPES``) trained on
     the same text (``--draft-seconds``), then on the target's samples (``--draft-kd-seconds``:
     sequence-level distillation); (b) ``eagle``: an EAGLE head trained by ``asyncrl train-draft``'s
     ``draft_head.train_head`` (random init, soft labels, 3 passes) on the target's samples
     (``--head-steps`` steps).
  5. timed rows, each drafter in its own engine, speculation off first: batch ``--tail-batch`` x
     ``--tail-tokens`` new tokens (EOS ignored) from held-out GSM8K test questions, greedy and at each
     temperature of ``--temperatures``; and workload (a) (batch 256, 256 random-token prompt, 256
     sampled tokens) off vs each drafter (speculation switches itself off above
     ``disable_by_batch_size``: this checks it costs nothing there). These rows speculate at every
     step they may (``adaptive: False``: the drafters' own speed).
  6. adaptive rows (``<drafter>_adaptive``): the same drafter with the engine's default gate
     (spec/adaptive.py: speculate only while speculative steps measure faster than plain decode),
     the tails only (workload (a) runs above ``disable_by_batch_size``, where the gate is not asked).
     The gate is reset after each warm-up, so the timed run pays for what the gate has to learn (a
     cold start; an engine kept across rollouts starts warm). ``gate_*``: its plain steps, probes,
     switches, and per batch bucket its last tokens/s estimates of both modes.

Every row reports tok/s, x off, acceptance, tokens per target pass and whether its tokens equal off;
beside them, what the generated text is: distinct-4-gram ratio, the loop share of each row's last
256 tokens (``text_lm.longest_repeat_suffix``) and the start of row 0 decoded. A briefly trained
model's long outputs may loop, and loops are what drafting likes: read the speed-ups with them.

    python bench/spec_trained_target.py --json bench/results/spec_trained_target_h200.json  # ~5.5 min, one H200
    python bench/spec_trained_target.py --tiny      # the same code path on CPU, tiny shapes, ~15 s
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # text_lm, spec_decode; appended: nothing shadowed
from spec_decode import timed  # noqa: E402
from text_lm import (chunk, distinct_ngrams, document, eval_loss, gsm8k_rows, longest_repeat_suffix,  # noqa: E402
                     new_lm, prompt_text, token_stream, train_lm, train_tokenizer)

from asyncrl.engine.bench import SHAPES, provenance, write_json  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402

# timed in this order (off first: the reference); n-gram after the drafters, its row is met elsewhere
# (bench/RESULTS.md); then the drafters with the adaptive gate (the tails only)
DRAFTERS = ("draft_model", "eagle", "ngram")
ADAPTIVE = tuple(f"{d}_adaptive" for d in DRAFTERS)
ROWS = ("off", *DRAFTERS, *ADAPTIVE)
# The draft model per target shape: same tokenizer (vocabulary) and head_dim as the target. 0.6B:
# 2 layers of width 512 (~7M without the embedding; its tied 512 x 151,936 LM head is 78M), so a
# drafted token costs a few graph-launched kernels (--draft-layers: deeper).
DRAFT_SHAPES = {
    "qwen3-0.6b": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "mini-32k": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
}
# --tiny: the same path at CPU size (tests/engine/spec/test_spec_trained_target.py runs it); workload (a)
# runs at batch 3 above a speculation threshold of 2 so that it exercises "speculation stays off"
TINY = dict(shape="tiny", vocab=320, corpus_rows=120, seq_len=48, target_steps=40, draft_steps=20, batch=4,
            head_prompts=2, head_len=12, head_steps=10, draft_kd_steps=3, head_batch_tokens=128, tail_batch=2,
            tail_tokens=12, a_batch=3, a_len=4, lr=3e-3, draft_lr=3e-3, disable_by_batch_size=2, device="cpu")


def engine_kwargs(dtype, device: str, max_len: int) -> dict:
    return dict(dtype=dtype, device=device, max_model_len=max_len, block_size=64 if device.startswith("cuda") else 16)


def build_text(args) -> dict:
    """Tokenizer, training chunks, held-out chunks and the tails' prompts (held-out questions)."""
    t0 = time.perf_counter()
    train_rows = gsm8k_rows(0, args.corpus_rows)
    test_rows = gsm8k_rows(1)
    tok = train_tokenizer([document(r) for r in train_rows], args.vocab)
    train_chunks = chunk(token_stream(tok, [document(r) for r in train_rows]), args.seq_len)
    heldout_rows, prompt_rows = test_rows[args.tail_batch:], test_rows[:args.tail_batch]
    heldout_chunks = chunk(token_stream(tok, [document(r) for r in heldout_rows[:400]]), args.seq_len)[:16]
    return dict(tokenizer=tok, train_chunks=train_chunks, heldout_chunks=heldout_chunks,
                tail_prompts=[tok.encode(prompt_text(r)).ids for r in prompt_rows],
                head_prompts=[tok.encode(prompt_text(r)).ids for r in train_rows[:args.head_prompts]],
                record=dict(corpus="GSM8K train (asyncrl/data/sets/gsm8k, MIT)", documents=len(train_rows),
                            tokenizer=f"byte-level BPE, {tok.get_vocab_size()} tokens, trained on the corpus",
                            train_tokens=train_chunks.numel(), train_chunks=len(train_chunks),
                            heldout="GSM8K test documents after the tails' questions",
                            tail_prompts=f"GSM8K test questions 0..{args.tail_batch - 1}",
                            seconds=round(time.perf_counter() - t0, 1)))


def train_model(name: str, shape: dict, text: dict, args, seconds, steps, lr: float, max_pos: int):
    """A model of ``shape`` trained on the corpus, cast to the engine's dtype; (model, record)."""
    model = new_lm(shape, max_pos, args.device, seed={"target": 0, "draft": 1}[name])
    params = sum(p.numel() for p in model.parameters())
    def log(step: int, loss: float) -> None:
        if step % 50 == 0:
            print(f"  {name} step {step}: loss {loss:.3f}", flush=True)
    rec = train_lm(model, text["train_chunks"], args.batch, lr, seconds=seconds, steps=steps, on_step=log)
    rec.update(params=params, heldout_loss=round(eval_loss(model, text["heldout_chunks"], args.batch, args.device), 3),
               epochs=round(rec["tokens"] / text["train_chunks"].numel(), 2), shape=shape)
    print(name, json.dumps(rec), flush=True)
    model = model.to(args.dtype)
    free_cuda()
    return model, rec


def target_samples(target, text: dict, args) -> tuple[list, dict]:
    """The trained target's own continuations of ``--head-prompts`` GSM8K training questions (half
    greedy, half at temperature 1; ``--head-len`` new tokens, EOS ignored), through train-draft's
    ``policy_samples``: what the EAGLE head trains on and what the draft model is distilled on."""
    from asyncrl.runtime.draft_job import policy_samples

    t0 = time.perf_counter()
    prompts = text["head_prompts"]
    half = len(prompts) // 2
    params = [SamplingParams(temperature=0.0 if i < half else 1.0, max_tokens=args.head_len, ignore_eos=True, seed=0)
              for i in range(len(prompts))]
    samples = policy_samples(target, prompts, params, args.device)
    rec = dict(prompts=len(prompts), sampled="half greedy, half temperature 1.0", new_tokens=args.head_len,
               sample_tokens=sum(len(s.token_ids) for s in samples), seconds=round(time.perf_counter() - t0, 1))
    print("samples", json.dumps(rec), flush=True)
    free_cuda()
    return samples, rec


def distill_draft(draft, samples: list, args) -> dict:
    """Sequence-level distillation: the draft model trained further on the target's own samples
    (``--draft-kd-seconds``), so it drafts what the target says rather than what the corpus says."""
    stream = torch.cat([torch.tensor(s.token_ids + [0]) for s in samples])
    chunks = chunk(stream, min(args.seq_len, stream.numel()))
    draft.float()
    rec = train_lm(draft, chunks, args.batch, args.draft_lr / 3, seconds=args.draft_kd_seconds,
                   steps=args.draft_kd_steps, warmup=1)
    draft.to(args.dtype)
    print("draft_kd", json.dumps(rec), flush=True)
    free_cuda()
    return rec


def train_eagle(target, samples: list, args, out_dir: str) -> dict:
    """An EAGLE head for ``target`` through train-draft's ``train_head`` (soft labels, 3 passes) on
    the target's samples, saved in ``out_dir``."""
    from asyncrl.engine.models.config import ModelConfig
    from asyncrl.engine.spec.eagle_head import new_head
    from asyncrl.training.draft_head import train_head

    head = new_head(ModelConfig.from_module(target), seed=0, init="random").to(target.device)
    batch = max(1, args.head_batch_tokens // (args.head_len + 64))
    log = lambda s, m: print(f"  eagle step {s + 1} {json.dumps({k: round(v, 3) for k, v in m.items()})}",  # noqa: E731
                             flush=True) if s % max(1, args.head_steps // 5) == 0 else None
    metrics = train_head(head, target, samples, args.head_steps, batch, args.head_lr, passes=3, on_step=log,
                         label="soft")
    head.save(out_dir)
    rec = dict(init="random", label="soft", passes=3, batch_size=batch,
               **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()})
    print("eagle", json.dumps(rec), flush=True)
    del head
    free_cuda()
    return rec


class PhaseClock:
    """``clock(name)`` records the seconds since the previous call under ``name`` (``.record``)."""

    def __init__(self):
        self.t, self.record = time.perf_counter(), {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.record[name] = round(now - self.t, 1)
        self.t = now


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def text_measures(tok, tokens: list[list[int]], sample: bool) -> dict:
    """Repetition of the generated rows, and (``sample``) the first 100 tokens of row 0 decoded."""
    rec = dict(distinct_4gram=distinct_ngrams(tokens, 4), loop_share_last_256=longest_repeat_suffix(tokens))
    if sample and tokens:
        rec["row0_start"] = tok.decode(tokens[0][:100])
    return rec


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets on CPU (the test's run)")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(DRAFT_SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE tokenizer size")
    ap.add_argument("--model-vocab", default="shape", choices=("shape", "tokenizer"),
                    help="the models' vocabulary: the shape's (151,936 for 0.6B: its real per-step cost) or "
                         "the tokenizer's")
    ap.add_argument("--corpus-rows", type=int, default=None, help="GSM8K training rows used (default: all 7,473)")
    ap.add_argument("--seq-len", type=int, default=None, help="training chunk length (default: tail + 256)")
    ap.add_argument("--batch", type=int, default=8, help="chunks per training step")
    ap.add_argument("--target-seconds", type=float, default=80.0)
    ap.add_argument("--target-steps", type=int, default=None, help="instead of --target-seconds (deterministic)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--draft-seconds", type=float, default=20.0)
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--draft-layers", type=int, default=None, help="the draft model's depth (default: DRAFT_SHAPES')")
    ap.add_argument("--draft-kd-seconds", type=float, default=8.0, help="then on the target's samples (0: not)")
    ap.add_argument("--draft-kd-steps", type=int, default=None)
    ap.add_argument("--head-prompts", type=int, default=64, help="GSM8K training questions the target answers "
                    "for the EAGLE head's samples (half greedy, half at temperature 1)")
    ap.add_argument("--head-len", type=int, default=None, help="new tokens per head sample (default: --tail-tokens)")
    ap.add_argument("--head-steps", type=int, default=100)
    ap.add_argument("--head-batch-tokens", type=int, default=8192)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-sampling", default="probabilistic", choices=("greedy", "probabilistic"),
                    help="drafts of sampled requests: sampled from the drafter's q (probabilistic) or its argmax; "
                         "greedy requests get argmax drafts either way")
    ap.add_argument("--disable-by-batch-size", type=int, default=32,
                    help="speculation runs only while at most this many sequences run (the engine's default)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--tail-batch", type=int, default=8)
    ap.add_argument("--tail-tokens", type=int, default=2048)
    ap.add_argument("--temperatures", default="0,1.0", help="the tails' temperatures (0 = greedy)")
    ap.add_argument("--a-batch", type=int, default=256, help="workload (a)'s batch (0: skip it)")
    ap.add_argument("--a-len", type=int, default=256)
    ap.add_argument("--off-again", action=argparse.BooleanOptionalAction, default=True,
                    help="time the greedy tail with speculation off again after the drafters' rows (x_off ~1.0 expected)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        args.target_seconds = args.draft_seconds = args.draft_kd_seconds = None
    args.seq_len = args.seq_len or args.tail_tokens + 256
    args.head_len = args.head_len or args.tail_tokens
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    args.rows = ["off"] + [r for r in args.rows.split(",") if r and r != "off"]
    unknown = set(args.rows) - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; known: {','.join(ROWS)}")
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    return args


def main(argv=None) -> dict:
    import tempfile

    from asyncrl.engine import LLM

    args = parse_args(argv)
    t_start = time.perf_counter()
    random.seed(0)
    results = dict(provenance(" ".join(sys.argv)), shape=args.shape, k=args.k, draft_sampling=args.draft_sampling,
                   rows={})
    if not args.device.startswith("cuda"):
        results["device"] = "cpu"
    phase = PhaseClock()
    text = build_text(args)
    results["text"] = text["record"]
    results["notes"] = [
        "target: the shape's layers and vocabulary rows (--model-vocab shape) trained from random init for "
        "target.seconds on GSM8K; ids past the tokenizer's are never seen: a real 0.6B's cost per step, "
        "not a real 0.6B's quality (target.heldout_loss)",
        "greedy rows: every drafter's tokens should equal off (bf16 near-ties aside, bench/RESULTS.md); "
        "sampled rows with probabilistic drafts follow the target's law, not off's tokens",
        "distinct_4gram / loop_share_last_256: how repetitive the generated text is; loops favour drafting",
    ]
    print("text", json.dumps(text["record"]), flush=True)
    tok = text["tokenizer"]
    shape = dict(SHAPES[args.shape])
    if args.model_vocab == "tokenizer":
        shape["vocab_size"] = tok.get_vocab_size()
    if shape["vocab_size"] < tok.get_vocab_size():
        raise SystemExit(f"--vocab {tok.get_vocab_size()} exceeds the shape's vocabulary {shape['vocab_size']}")
    max_len = max(args.seq_len, max(map(len, text["tail_prompts"])) + args.tail_tokens, 2 * args.a_len) + 64
    phase("text")
    target, results["target"] = train_model("target", shape, text, args, args.target_seconds, args.target_steps,
                                            args.lr, max_len)
    phase("target")
    common = {"num_speculative_tokens": args.k, "disable_by_batch_size": args.disable_by_batch_size}
    specs = {"off": None, "ngram": {"method": "ngram", **common}}
    samples = None
    drafters = {r.removesuffix("_adaptive") for r in args.rows}  # an adaptive row needs its drafter built
    if {"draft_model", "eagle"} & drafters:
        samples, results["target_samples"] = target_samples(target, text, args)
        phase("target_samples")
    if "draft_model" in drafters:
        draft_shape = {**DRAFT_SHAPES[args.shape], "vocab_size": shape["vocab_size"]}
        if args.draft_layers:
            draft_shape["num_hidden_layers"] = args.draft_layers
        draft, results["draft_model"] = train_model("draft", draft_shape, text, args, args.draft_seconds,
                                                    args.draft_steps, args.draft_lr, max_len)
        if args.draft_kd_seconds or args.draft_kd_steps:
            results["draft_model"]["distilled"] = distill_draft(draft, samples, args)
        phase("draft_model")
        specs["draft_model"] = {"method": "draft_model", "model": draft, **common,
                                "draft_sampling": args.draft_sampling}
    if "eagle" in drafters:
        head_dir = tempfile.mkdtemp(prefix="eagle_head_")
        results["eagle"] = train_eagle(target, samples, args, head_dir)
        phase("eagle_head")
        specs["eagle"] = {"method": "eagle", "model": head_dir, **common,
                          "draft_sampling": args.draft_sampling}
    results["train_s"] = round(time.perf_counter() - t_start, 1)
    specs = {n: spec and dict(spec, adaptive=False) for n, spec in specs.items()}
    specs.update({f"{d}_adaptive": dict(specs[d], adaptive=True) for d in DRAFTERS if d in specs})
    specs = {n: specs[n] for n in ROWS if n in args.rows and n in specs}
    g = torch.Generator().manual_seed(1)
    a_prompts = torch.randint(1, tok.get_vocab_size(), (args.a_batch, args.a_len), generator=g).tolist()
    a_params = SamplingParams(temperature=1.0, max_tokens=args.a_len, ignore_eos=True, seed=0)
    reference = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        llm = LLM(target, speculative_config=spec, **engine_kwargs(args.dtype, args.device, max_len))
        row = dict(startup_s=round(time.perf_counter() - t0, 1))
        adaptive = name.endswith("_adaptive")
        for temp in args.temperatures:
            key = "greedy" if temp == 0 else f"t{temp:g}"
            params = SamplingParams(temperature=temp, max_tokens=args.tail_tokens, ignore_eos=True, seed=0)
            row[key], tokens = timed(llm, text["tail_prompts"], params, args.device,
                                     after_warmup=(lambda e: e.spec.gate.reset()) if adaptive else None)
            if adaptive:
                row[key]["gate_buckets"] = {str(b): {k: round(v, 1) if isinstance(v, float) else v
                                                     for k, v in e.items()}
                                            for b, e in llm.spec.gate.estimates.items()}
            reference.setdefault(key, tokens)
            row[key]["same_tokens_as_off"] = tokens == reference[key]
            row[key].update(text_measures(tok, tokens, sample=name == "off"))
            if name != "off":
                row[key]["x_off"] = round(row[key]["tokens_per_s"] / results["rows"]["off"][key]["tokens_per_s"], 3)
        if args.a_batch and not adaptive:
            row["a"], _ = timed(llm, a_prompts, a_params, args.device)
            if name != "off":
                row["a"]["x_off"] = round(row["a"]["tokens_per_s"] / results["rows"]["off"]["a"]["tokens_per_s"], 3)
        results["rows"][name] = row
        phase(f"row_{name}")
        results["phase_s"] = phase.record
        print(name, json.dumps(row), flush=True)
        write_json(args.json, results)  # after every row: a later failure keeps what was measured
        llm.close()
        del llm
        free_cuda()
    if args.off_again and "greedy" in reference:  # off again, last: an "off" slowed by going first shows here
        llm = LLM(target, **engine_kwargs(args.dtype, args.device, max_len))
        params = SamplingParams(temperature=0, max_tokens=args.tail_tokens, ignore_eos=True, seed=0)
        row, tokens = timed(llm, text["tail_prompts"], params, args.device)
        row.update(same_tokens_as_off=tokens == reference.get("greedy"),
                   x_off=round(row["tokens_per_s"] / results["rows"]["off"]["greedy"]["tokens_per_s"], 3))
        results["rows"]["off_again"] = {"greedy": row}
        print("off_again", json.dumps(row), flush=True)
        llm.close()
        del llm
        free_cuda()
        phase("row_off_again")
        results["phase_s"] = phase.record
    results["summary"] = {f"{n}/{k}": r[k]["x_off"] for n, r in results["rows"].items() if n != "off"
                          for k in r if isinstance(r[k], dict) and "x_off" in r[k]}
    results["bars"] = {f"{n}/greedy >= 1.8x off": r["greedy"]["x_off"] >= 1.8 for n, r in results["rows"].items()
                       if n.removesuffix("_adaptive") in ("draft_model", "eagle") and "greedy" in r}
    results["bars"].update({f"{n}/{k} >= 0.95x off (adaptive: no slower than off where drafts do not pay)":
                            r[k]["x_off"] >= 0.95 for n, r in results["rows"].items() if n.endswith("_adaptive")
                            for k in r if k.startswith("t") and isinstance(r[k], dict)})
    results["bars"].update({f"{n}/a not slower than off (>= 0.97x, timing noise)": r["a"]["x_off"] >= 0.97
                            for n, r in results["rows"].items() if n != "off" and "a" in r})
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    print("summary", json.dumps(results["summary"]), json.dumps(results["bars"]), "total_s", results["total_s"],
          flush=True)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
