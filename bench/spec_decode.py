"""Speculative decoding speed (issue 23): tokens/s with speculation on vs off, same run.

Rows (0.6B shape on a GPU, random weights built from Qwen3-0.6B's config):
  long tail:  batch 8 x 2,048 new tokens, greedy, a repetitive prompt (a pattern repeated);
              off / n-gram drafting / a draft model (the target's first 2 layers with its
              embeddings and head: a small model of the same tokenizer)
  workload a: batch 256, prompt 256, response 256, sampled; off / n-gram (adaptive: speculation
              stays off above ``disable_by_batch_size``, so this measures its cost when idle)

Random weights make acceptance rates unlike a trained model's (a random model's greedy text is
repetitive); each row prints its acceptance rate and tokens per target pass beside the speed.

    python bench/spec_decode.py --json bench/results/spec_decode_h200.json      # ~1.5 min, one H200
    python bench/spec_decode.py --quiet-upper 0.05 --a-batch 8 --json ...   # a target the 2-layer draft agrees with
    python bench/spec_decode.py --shape tiny --device cpu --tail-tokens 64 --a-batch 16   # CPU smoke

Issue 23's per-round view (``--profile-rounds N``: per phase host / device ms and the CUDA runtime
calls per round, ``spec_round_profile.py``), with an EAGLE row (the copy head of spec_eagle.py)
and the probabilistic drafters of spec_trained_target.py; a "+q" row is the same drafter with
``ASYNCRL_SPEC_GREEDY_Q`` semantics (q computed on greedy rows: the code before the fix):

    python bench/spec_decode.py --quiet-upper 0.05 --a-batch 0 --tail-tokens 1024 --draft-sampling probabilistic \
        --rows off,ngram,draft_model,draft_model+q,eagle,eagle+q --profile-rounds 32 --json ...
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncrl.engine.spec.draft_model as draft_model_module  # noqa: E402
from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import SHAPES, build_random_hf, provenance, write_json  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402


def draft_from_target(target, layers: int):
    """A small model of the same tokenizer: the target's first ``layers`` layers, embeddings,
    final norm and head (a truncated copy, as layer-skip self-speculation drafts)."""
    from transformers import AutoModelForCausalLM

    overrides = {"num_hidden_layers": layers}
    if getattr(target.config, "layer_types", None):  # newer transformers check one type per layer
        overrides["layer_types"] = target.config.layer_types[:layers]
    cfg = type(target.config)(**{**target.config.to_dict(), **overrides})
    with torch.device(target.device):
        draft = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    return draft.eval()


def repetitive_prompt(vocab: int, seed: int, offset: int, period: int = 8, repeats: int = 8) -> list[int]:
    """The long tail's repetitive kind of prompt: a random ``period``-token pattern (drawn with
    ``seed``) repeated ``repeats`` times, entered at ``offset``, then the token ``offset + 1``.
    The timed tails are seed 0 with offsets 0..batch-1 (one pattern, eight entry points);
    spec_eagle.py's ``--train-task repetitive`` trains on other seeds (another pattern each)."""
    pattern = torch.randint(1, vocab, (period,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (pattern * repeats)[offset:] + [offset + 1]


def quiet_upper_layers(model, first: int, scale: float) -> None:
    """Scale the residual writes (attention o_proj, MLP down_proj) of layers ``first..`` by ``scale``.

    A random model's upper layers change its output as much as its lower ones, so no truncated
    draft agrees with it (0.04% acceptance); a trained model's later layers refine rather than
    rewrite. With ``scale`` < 1 the target stays a full-cost 28-layer model whose first layers
    decide most of its output, so the draft-model path runs at a realistic acceptance rate."""
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def timed(llm, prompts, params, device: str, after_warmup=None):
    """Warm-up with the whole workload, then the timed run: (row, token lists). Speculative counters
    are the timed run's (bench/spec_trained_target.py uses this too); with the adaptive gate
    (spec/adaptive.py) also its plain steps and probes, and its last estimates of both modes.
    ``after_warmup(llm)``: called between the two (spec_trained_target.py resets the gate there)."""
    # Warm-up = the whole workload once: Triton compiles kernels per context-length bucket, so a
    # shorter warm-up left the first configuration paying compiles in its timed run (H200: "off"
    # 28.6k vs 47.8k tok/s for the same plain decode path in the second engine).
    llm.generate(prompts, params)
    if after_warmup is not None:
        after_warmup(llm)
    m0 = dict(llm.metrics)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = [list(c.token_ids) for o in outs for c in o.outputs]
    n = sum(len(t) for t in tokens)
    row = dict(tokens=n, seconds=round(dt, 3), tokens_per_s=round(n / dt, 1))
    m = llm.metrics
    if "spec_steps" in m:
        d = {k: m[f"spec_{k}"] - m0[f"spec_{k}"] for k in ("steps", "rows", "draft_tokens", "accepted_tokens")}
        row.update(spec_steps=d["steps"], rounds=d["rows"], drafted=d["draft_tokens"], accepted=d["accepted_tokens"],
                   acceptance_rate=round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"] else 0.0,
                   tokens_per_target_pass=round((d["rows"] + d["accepted_tokens"]) / max(d["rows"], 1), 3)
                   if d["rows"] else 1.0)
    if "spec_gate_plain_steps" in m:
        row.update(gate_plain_steps=m["spec_gate_plain_steps"] - m0["spec_gate_plain_steps"],
                   gate_probes=m["spec_gate_probes"] - m0["spec_gate_probes"],
                   gate_switches=m["spec_gate_switches"] - m0["spec_gate_switches"],
                   gate_bucket=m["spec_gate_bucket"], gate_spec_tokens_per_s=m["spec_gate_spec_tokens_per_s"],
                   gate_plain_tokens_per_s=m["spec_gate_plain_tokens_per_s"])
    if "spec_seconds" in m:  # where the wall went: speculative steps, catch-ups, the rest (plain + host)
        d = {k: m[f"spec_{k}"] - m0[f"spec_{k}"] for k in ("seconds", "catch_up_seconds", "catch_up_steps",
                                                            "catch_up_tokens", "plain_seconds", "plain_timed_steps")}
        row.update(spec_s=round(d["seconds"], 3), catch_up_s=round(d["catch_up_seconds"], 3),
                   catch_up_steps=d["catch_up_steps"], catch_up_tokens=d["catch_up_tokens"],
                   other_s=round(dt - d["seconds"] - d["catch_up_seconds"], 3),
                   plain_steps=m["decode_steps"] - m0["decode_steps"],
                   plain_timed_s=round(d["plain_seconds"], 3), plain_timed_steps=d["plain_timed_steps"])
    return row, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tail-batch", type=int, default=8)
    ap.add_argument("--tail-tokens", type=int, default=2048)
    ap.add_argument("--a-batch", type=int, default=256)
    ap.add_argument("--a-len", type=int, default=256, help="prompt and response length of workload a")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--quiet-upper", type=float, default=None, metavar="SCALE",
                    help="scale the target's layers past --draft-layers by SCALE (a target a truncated draft agrees with)")
    ap.add_argument("--draft-sampling", default="greedy", choices=("greedy", "probabilistic"),
                    help="the draft model's and EAGLE head's draft_sampling")
    ap.add_argument("--rows", default="off,ngram,draft_model",
                    help="of off, ngram, draft_model, eagle (copy head); NAME+q: q on greedy rows (before issue 23's fix)")
    ap.add_argument("--profile-rounds", type=int, default=0, metavar="N",
                    help="per speculative row: phases (host / device ms) of N rounds and runtime calls per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    max_len = max(args.tail_tokens + 64, 2 * args.a_len) + 64
    hf = build_random_hf(args.shape, dtype, dev, max_len)
    if args.quiet_upper is not None:
        quiet_upper_layers(hf, args.draft_layers, args.quiet_upper)
    vocab = hf.config.vocab_size
    tail_prompts = [repetitive_prompt(vocab, seed=0, offset=i) for i in range(args.tail_batch)]
    tail_params = SamplingParams(temperature=0, max_tokens=args.tail_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    a_prompts = torch.randint(1, vocab, (args.a_batch, args.a_len), generator=g).tolist()
    a_params = SamplingParams(temperature=1.0, max_tokens=args.a_len, ignore_eos=True, seed=0)
    engine_kw = dict(dtype=dtype, device=dev, max_model_len=max_len, block_size=64 if dev.startswith("cuda") else 16)
    rows = args.rows.split(",")
    specs = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k}}
    if any(r.startswith("draft_model") for r in rows):
        specs["draft_model"] = {"method": "draft_model", "model": draft_from_target(hf, args.draft_layers),
                                "num_speculative_tokens": args.k, "draft_sampling": args.draft_sampling}
    if any(r.startswith("eagle") for r in rows):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from spec_eagle import copy_head
        head_dir = tempfile.mkdtemp(prefix="eagle_copy_")
        copy_head(hf).save(head_dir)
        specs["eagle"] = {"method": "eagle", "model": head_dir, "num_speculative_tokens": args.k,
                          "draft_sampling": args.draft_sampling}
    results = dict(provenance(" ".join(sys.argv)), shape=args.shape, k=args.k, quiet_upper=args.quiet_upper,
                   tail=f"{args.tail_batch} x {args.tail_tokens} greedy",
                   a=f"{args.a_batch} x {args.a_len}+{args.a_len} sampled", draft_sampling=args.draft_sampling,
                   rows={})
    if not dev.startswith("cuda"):
        results["device"] = "cpu"
    reference = None
    for name in rows:
        spec = specs[name.removesuffix("+q")]
        draft_model_module.GREEDY_ROUNDS_SKIP_Q = not name.endswith("+q")
        t0 = time.perf_counter()
        # the drafter's own speed: every step speculates (the adaptive gate off; spec_trained_target.py times it)
        llm = LLM(hf, speculative_config=spec and dict(spec, adaptive=False), **engine_kw)
        row = dict(startup_s=round(time.perf_counter() - t0, 1))
        row["tail"], tokens = timed(llm, tail_prompts, tail_params, dev)
        reference = reference or tokens
        row["tail"]["same_tokens_as_off"] = tokens == reference
        if args.profile_rounds and spec is not None:
            from spec_round_profile import profile_rounds
            row["profile"] = profile_rounds(llm, tail_prompts, tail_params, args.profile_rounds)
            row["profile"]["phases"]["ms_per_round_timed"] = round(1e3 * row["tail"]["seconds"] /
                                                                   max(row["tail"].get("spec_steps", 0), 1), 3)
        if name in ("off", "ngram") and args.a_batch:
            row["a"], _ = timed(llm, a_prompts, a_params, dev)
        results["rows"][name] = row
        print(name, json.dumps(row), flush=True)
        llm.close()
        del llm
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    draft_model_module.GREEDY_ROUNDS_SKIP_Q = True
    off = results["rows"].get("off")
    if off is not None:
        results["speedup_tail"] = {n: round(r["tail"]["tokens_per_s"] / off["tail"]["tokens_per_s"], 3)
                                   for n, r in results["rows"].items() if n != "off"}
        if "a" in off and "a" in results["rows"].get("ngram", {}):
            results["speedup_a_ngram"] = round(results["rows"]["ngram"]["a"]["tokens_per_s"] / off["a"]["tokens_per_s"], 3)
        print(json.dumps({k: results[k] for k in ("speedup_tail", "speedup_a_ngram") if k in results}), flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
