"""EAGLE speculation on one GPU (issue 23): a head trained inside the bench, then tokens/s vs off.

A random-weight target has no text to learn from, so the bench does what ``asyncrl train-draft``
does, on the target itself: the engine generates greedy continuations of ``--train-prompts``
random prompts (``--train-len`` new tokens each, by default as long as the timed tails: the head's
attention must have seen contexts as long as the ones it drafts in; a head trained on 128-token
samples kept 0.91 acceptance over the first 128 tokens of the H200 tail and 0.11 over its 2,048),
and ``training/draft_head.train_head`` (``--batch-tokens`` per step) fits a
fresh head to the target's features and next-token distributions (``--steps`` steps, 3 chained
passes). With ``--train-task random`` (the default) the timed tails' prompts are among the training
prompts (their first ``--train-len`` tokens; ``--no-train-on-tails``: not): a random target's continuations of fresh random prompts are
runs of tokens the head never saw, so on those a head shows how much it memorised, not what the
engine does with a trained head (``train.replay_heldout``: the trained head on fresh prompts, from
the replay below). ``--train-task repetitive`` trains on the task instead of on the tails' text:
spec_decode.py's repetitive prompts with other seeds (another pattern per prompt; held-out prompts
likewise), the tails' prompts never among them (``train.tails_held_out``; seeds in ``train`` and
``tail_prompts``). ``--head-init identity`` (train-draft's ``draft.head_init``) starts the head as
drafting the target's last choice again instead of from random weights: tokens the samples never
contained (a 152k vocabulary against a few thousand sampled tokens) keep that rule. Then, each in
its own engine (same run, same prompts):

  long tail:  batch 8 x 2,048 new tokens, greedy, on (i) spec_decode.py's repetitive prompts and
              (ii) random prompts; off / n-gram / EAGLE trained (and on (ii) only: EAGLE untrained,
              and EAGLE trained with its draft steps eager instead of in CUDA graphs)
  workload a: batch 256, prompt 256, response 256, sampled; off / EAGLE trained (speculation stays
              off above ``disable_by_batch_size``: this measures that it costs nothing there)

Each row prints acceptance, tokens per target pass (and the rounds / drafts / accepted drafts of
the timed run) and whether the tokens equal speculation off (if not: ``divergence``, the first
differing position per row and the target's logit gaps there: near-ties or a wrong token).

What a head must show in the engine is known without the engine: ``training/draft_replay.py``
replays greedy drafting from the head's training forward over greedy tokens and gives the engine's
exact rounds, drafts and accepted drafts (equal on CPU; tests/engine/spec/test_eagle.py). So:

  replay.<tail>.<head>   every head replayed on the off row's tokens (the held-out generations the
                         EAGLE rows produce again): the acceptance each EAGLE row must reach; on GPU
                         also ``trained_fp32`` (the bf16 engine head vs the fp32 trained one)
  replay.<tail>_first_N  the trained head on the first ``--train-len`` tokens only (the length it trained
                         on; only when it is shorter than the tails)
  <row>.<tail>.replay    the row's head replayed on the row's own tokens: equal to the row's counts
                         unless the engine drafts something else than the training forward
  eagle_copy             a head built to draft the last token again (no training): checks the engine's
                         EAGLE path alone (a random target mostly repeats its last token)
  train.replay_on_training_samples / train.forward_check   the trained head on its own samples without
                         autograd, and the training forward (autograd, autocast, GPU kernels) vs an fp32
                         math-SDPA eager reference: a head that looks good only in its training forward

``train.agree_j`` is measured on the batches the head trains on; the acceptance of a k-draft chain
is not agree_1 (every draft after a miss is lost): compare the rows with ``replay``.

    python bench/spec_eagle.py --json bench/results/spec_eagle_h200.json         # ~4-5 min, one H200
    python bench/spec_eagle.py --rows off,ngram,eagle_copy,eagle --tails random --a-batch 0 --steps 150 \
        --profile-rounds 64 --json ...     # ~3-4 min: tok/s vs off, acceptance, where a round's time goes
    python bench/spec_eagle.py --quiet-upper 0.05 --json ...   # a target whose first layers decide its output
    python bench/spec_eagle.py --train-task repetitive --no-train-on-tails --tails repetitive \
        --rows off,ngram,eagle_copy,eagle --a-batch 0 --head-init identity --label soft --train-prompts 96 \
        --steps 100 --json ...   # ~4 min, one H200: the draft-model row on the repetitive task, the head
        # trained on other prompts of the task (identity + soft labels: training erodes the init's
        # rule on unseen tokens least; bench/RESULTS.md, issue 23, branch i23r)
    python bench/spec_eagle.py --shape tiny --device cpu --tail-tokens 64 --a-batch 16 --train-len 64 --steps 300
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

from spec_decode import quiet_upper_layers, repetitive_prompt, timed  # noqa: E402
from spec_round_profile import profile_rounds  # noqa: E402

import asyncrl.engine.spec.eagle as eagle_module  # noqa: E402
from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import SHAPES, build_random_hf, provenance, write_json  # noqa: E402
from asyncrl.engine.models.config import ModelConfig  # noqa: E402
from asyncrl.engine.spec.eagle_head import load_head, new_head  # noqa: E402
from asyncrl.training.draft_head import DraftSample, train_head  # noqa: E402
from asyncrl.training.draft_replay import replay_acceptance  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402


ROWS = ("off", "ngram", "eagle_untrained", "eagle_copy", "eagle_eager", "eagle")
# prompt seeds: the timed tails (repetitive: seed 0, offsets 0..batch-1; random: seed 3) are none of
# the training (7 / 1000 + i) or held-out (5 / 2000 + i) prompts' seeds
TAIL_SEEDS = {"repetitive": 0, "random": 3}
TRAIN_SEED0, HELDOUT_SEED0 = 1000, 2000


def task_prompts(task: str, vocab: int, n: int, seed0: int) -> list[list[int]]:
    """``n`` prompts of the training task: ``random`` = 16 random tokens each (one generator,
    seed ``seed0``); ``repetitive`` = spec_decode.py's repetitive prompt with seed ``seed0 + i``
    (another 8-token pattern per prompt) entered at offset ``i % 8``, as the tail's rows are."""
    if task == "random":
        return torch.randint(1, vocab, (n, 16), generator=torch.Generator().manual_seed(seed0)).tolist()
    return [repetitive_prompt(vocab, seed=seed0 + i, offset=i % 8) for i in range(n)]


def train_on_target(hf, engine_kw: dict, args, out_dir: str, tail_prompts: list, train: bool = True) -> dict:
    """Greedy samples of the target from random prompts (and, with ``--train-on-tails``, the timed
    tails' prompts) -> a trained head in ``out_dir`` (+ an untrained one in ``out_dir/initial`` and
    the copy head in ``out_dir/copy``); returns the training record, with the trained head's replay
    on ``--heldout-prompts`` prompts it never saw (``replay_heldout``). ``train=False``: only the
    untrained and the copy heads (no row needs a trained one); returns None."""
    if not train:
        new_head(ModelConfig.from_module(hf), seed=0, init=args.head_init).save(f"{out_dir}/initial")
        copy_head(hf).save(f"{out_dir}/copy")
        return None
    vocab, task = hf.config.vocab_size, args.train_task
    seeds = (7, 5) if task == "random" else (TRAIN_SEED0, HELDOUT_SEED0)
    prompts = task_prompts(task, vocab, args.train_prompts, seeds[0])
    heldout = task_prompts(task, vocab, args.heldout_prompts, seeds[1])
    trained_on = prompts + (tail_prompts if args.train_on_tails else [])
    overlap = sum(p in trained_on for p in heldout) + (0 if args.train_on_tails else sum(p in prompts for p in tail_prompts))
    if overlap:
        raise RuntimeError(f"{overlap} held-out or tail prompts are among the training prompts")
    print(f"train: task {task}, {len(prompts)} prompts (seeds {describe_seeds(task, seeds[0], len(prompts))}), "
          f"held-out {len(heldout)} (seeds {describe_seeds(task, seeds[1], len(heldout))}); the timed tails' "
          f"prompts are {'AMONG' if args.train_on_tails else 'NOT among'} the training prompts", flush=True)
    t0 = time.perf_counter()
    llm = LLM(hf, **engine_kw)
    outs = llm.generate(trained_on + heldout, SamplingParams(temperature=0, max_tokens=args.train_len, ignore_eos=True))
    llm.close()
    del llm
    gen_s = time.perf_counter() - t0
    all_samples = [DraftSample(o.prompt_token_ids + c.token_ids, len(o.prompt_token_ids))
                   for o in outs for c in o.outputs]
    samples, heldout_samples = all_samples[:len(trained_on)], all_samples[len(trained_on):]
    head = new_head(ModelConfig.from_module(hf), seed=0, init=args.head_init)
    head.save(f"{out_dir}/initial")
    head.to(hf.device)
    log = lambda s, m: print(f"  step {s + 1} {json.dumps({k: round(v, 3) for k, v in m.items()})}", flush=True) \
        if s % max(1, args.steps // 10) == 0 else None  # noqa: E731
    metrics = train_head(head, hf, samples, args.steps, args.batch_size, args.lr, passes=3, on_step=log,
                         label=args.label)
    head.save(out_dir)
    # the trained head replayed on 8 of its own training samples, in eval mode and without autograd:
    # ~ agree_j above, else the training forward (autograd, autocast, compiled norms) is not the one
    # the engine and the replays run
    seen = replay_acceptance(head, hf, samples[:8], args.k)
    copy_head(hf).save(f"{out_dir}/copy")
    return dict(task=task, head_init=args.head_init, prompt_seeds=describe_seeds(task, seeds[0], len(prompts)),
                heldout_seeds=describe_seeds(task, seeds[1], len(heldout)), tails_held_out=not args.train_on_tails,
                samples=len(samples), sample_tokens=sum(len(s.token_ids) for s in samples),
                generate_s=round(gen_s, 1), **metrics, replay_on_training_samples=seen,
                replay_heldout=replay_acceptance(head, hf, heldout_samples, args.k) if heldout_samples else None,
                batch_size=args.batch_size, forward_check=forward_check(head, hf, samples[:2]))


def describe_seeds(task: str, seed0: int, n: int) -> str:
    """The seeds of ``task_prompts(task, ., n, seed0)``, for the JSON."""
    return f"one generator, seed {seed0}" if task == "random" else f"{seed0}..{seed0 + n - 1}, offset i % 8"


def forward_check(head, hf, samples, passes: int = 3) -> dict:
    """Per pass j, the share of positions where the training forward (autograd on, bf16 autocast on
    CUDA, the default SDPA backend, compiled norms) and a reference forward (fp32, no autocast, the
    math SDPA backend, eager norms) give the same LM-head argmax: ~1.0 unless the GPU kernels of
    the training forward compute something else than the engine (which the reference matches)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from asyncrl.engine.models import decoder
    from asyncrl.training.draft_head import pad_samples, policy_inputs
    from asyncrl.training.draft_replay import lm_head_argmax

    ids, _ = pad_samples(samples, hf.device)
    feats, embeds = policy_inputs(hf, ids)
    with torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
        train_like = [lm_head_argmax(g.detach(), hf.lm_head.weight) for g in head.unrolled(embeds, feats, passes)]
    compiled = [decoder.rms_norm, decoder.add_rms_norm, decoder.qkv_prepare, decoder.silu_and_mul]
    flags = [f.enabled for f in compiled]
    try:
        for f in compiled:
            f.enabled = False
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            ref = [lm_head_argmax(g, hf.lm_head.weight.float()) for g in head.unrolled(embeds, feats, passes)]
    finally:
        for f, on in zip(compiled, flags):
            f.enabled = on
    return {f"same_argmax_{j + 1}": round(float((a == b).float().mean()), 4)
            for j, (a, b) in enumerate(zip(train_like, ref))}


def copy_head(hf):
    """A head built, not trained, to draft the last token again (fc passes the token embedding,
    attention and MLP write nothing: g = norm(embed(token)), whose tied-LM-head argmax is that
    token). A random-weight target mostly repeats its last token, so this head's acceptance in the
    engine is high and known without training: a check of the engine's EAGLE path alone."""
    head = new_head(ModelConfig.from_module(hf), seed=0)
    H = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H].copy_(torch.eye(H))
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return head


def replay_rows(head, hf, prompts, tokens, k: int, upto=None) -> dict:
    """``replay_acceptance`` of ``head`` over greedy generations (prompt + tokens, the first
    ``upto`` new tokens if given): the acceptance the engine must show on exactly these tokens."""
    samples = [DraftSample(p + t[:upto], len(p)) for p, t in zip(prompts, tokens)]
    return replay_acceptance(head, hf, samples, k)


@torch.no_grad()
def divergence(hf, prompts, off: list, on: list) -> list[dict]:
    """Rows whose greedy tokens differ from speculation off: the first differing position and, in
    the (HF) target's logits there, the gap between off's token and this row's token and the top-2
    gap. Gaps within the dtype's rounding of the logits say: a near-tie that different kernels
    (the paged decode vs the (k+1)-query verify) may break either way, not a wrong token."""
    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, off, on)):
        if a == b:
            continue
        d = next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
        ids = torch.tensor([p + a[:d]], device=hf.device)
        logits = hf(input_ids=ids).logits[0, -1].float()
        top2 = logits.topk(2).values
        rows.append(dict(row=i, position=d, off_token=a[d] if d < len(a) else None,
                         token=b[d] if d < len(b) else None,
                         gap=round(float(logits[a[d]] - logits[b[d]]), 4) if d < min(len(a), len(b)) else None,
                         top2_gap=round(float(top2[0] - top2[1]), 4), top1_logit=round(float(top2[0]), 3)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tail-batch", type=int, default=8)
    ap.add_argument("--tails", default="repetitive,random", help="long tails to time: repetitive, random or both")
    ap.add_argument("--tail-tokens", type=int, default=2048)
    ap.add_argument("--a-batch", type=int, default=256, help="workload a's batch (0: skip workload a)")
    ap.add_argument("--a-len", type=int, default=256)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows to run, of {','.join(ROWS)} "
                    "(off always runs: the reference)")
    ap.add_argument("--profile-rounds", type=int, default=0, metavar="N",
                    help="after its timed random tail, profile N rounds of each speculative row "
                         "(spec_round_profile.py: host vs device ms per phase, CUDA runtime calls per round)")
    ap.add_argument("--train-prompts", type=int, default=64, help="distinct prompts generated for training")
    ap.add_argument("--train-len", type=int, default=None, help="new tokens per training sample (default: "
                    "--tail-tokens: a head trained on 128-token samples kept 0.91 acceptance on the first 128 "
                    "tokens of the H200 tail and 0.11 over its 2,048, as its attention had never seen a long "
                    "context)")
    ap.add_argument("--train-task", default="random", choices=("random", "repetitive"),
                    help="the training (and held-out) prompts: random tokens, or spec_decode.py's repetitive "
                         "prompts with other seeds than the tail's (another pattern per prompt; needs "
                         "--no-train-on-tails: the head must draft a task, not text it has seen)")
    ap.add_argument("--train-on-tails", action=argparse.BooleanOptionalAction, default=None,
                    help="add the timed tails' prompts to the training prompts (their first --train-len tokens; "
                         "default: on with --train-task random, off with repetitive): a random target's "
                         "continuations of random prompts share nothing a head could generalise from, so "
                         "held-out prompts measure memorisation, not the engine (their acceptance: "
                         "train.replay_heldout)")
    ap.add_argument("--heldout-prompts", type=int, default=8, help="fresh prompts for train.replay_heldout")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per training step "
                    "(default: --batch-tokens // sample length, at least 1)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per training step when --batch-size "
                    "is not given (the loss holds [tokens, vocabulary] logits per pass)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--label", default="token", choices=("soft", "token"),
                    help="train-draft's draft.label: a random model's next-token distribution is nearly flat, so "
                         "from a random init its greedy argmax (the sample's own token) is the signal; from "
                         "--head-init identity, soft labels pull unseen tokens toward the seen ones least")
    ap.add_argument("--head-init", default="random", choices=("random", "identity"),
                    help="train-draft's draft.head_init: the trained (and the untrained) head's starting weights; "
                         "identity = drafting the target's last choice again (eagle_head.new_head)")
    ap.add_argument("--quiet-upper", type=float, default=None, metavar="SCALE",
                    help="scale the residual writes of layers >= 2 by SCALE (spec_decode.py's quiet target)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = ["off"] + [r for r in args.rows.split(",") if r and r != "off"]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        ap.error(f"--rows: unknown rows {unknown}; known: {','.join(ROWS)}")
    if args.train_task == "repetitive" and args.train_on_tails:
        ap.error("--train-task repetitive trains on prompts other than the timed tails': drop --train-on-tails")
    if args.train_on_tails is None:
        args.train_on_tails = args.train_task == "random"
    args.train_len = args.train_len or args.tail_tokens
    args.batch_size = args.batch_size or max(1, args.batch_tokens // (args.train_len + 16))
    dev = args.device
    cuda = dev.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    max_len = max(args.tail_tokens, args.train_len, 2 * args.a_len) + 128
    hf = build_random_hf(args.shape, dtype, dev, max_len)
    if args.quiet_upper is not None:
        quiet_upper_layers(hf, 2, args.quiet_upper)
    engine_kw = dict(dtype=dtype, device=dev, max_model_len=max_len, block_size=64 if cuda else 16)
    head_dir = tempfile.mkdtemp(prefix="eagle_head_")
    results = dict(provenance(" ".join(sys.argv)), shape=args.shape, k=args.k, quiet_upper=args.quiet_upper, rows={})
    if not cuda:
        results["device"] = "cpu"
    vocab = hf.config.vocab_size
    tails = {"repetitive": [repetitive_prompt(vocab, seed=TAIL_SEEDS["repetitive"], offset=i)
                            for i in range(args.tail_batch)],
             "random": task_prompts("random", vocab, args.tail_batch, TAIL_SEEDS["random"])}
    tails = {t: tails[t] for t in args.tails.split(",")}
    results["tail_prompts"] = {t: (f"one generator, seed {TAIL_SEEDS[t]}" if t == "random"
                                   else f"seed {TAIL_SEEDS[t]}, offsets 0..{args.tail_batch - 1}")
                               for t in tails}
    comparison_tail = "random" if "random" in tails else next(iter(tails))
    trained = bool({"eagle", "eagle_eager"} & set(rows))
    results["train"] = train_on_target(hf, engine_kw, args, head_dir, tails.get("repetitive", []) +
                                       tails.get("random", []), train=trained)
    print("train", json.dumps(results["train"]), flush=True)
    tail_params = SamplingParams(temperature=0, max_tokens=args.tail_tokens, ignore_eos=True)
    a_prompts = torch.randint(1, vocab, (args.a_batch, args.a_len), generator=torch.Generator().manual_seed(1)).tolist()
    a_params = SamplingParams(temperature=1.0, max_tokens=args.a_len, ignore_eos=True, seed=0)
    eagle = lambda path: {"method": "eagle", "model": path, "num_speculative_tokens": args.k}  # noqa: E731
    # eagle_eager: the head's draft steps without their CUDA graphs (one tail), before the graph row
    specs = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
             "eagle_untrained": eagle(f"{head_dir}/initial"), "eagle_copy": eagle(f"{head_dir}/copy"),
             "eagle_eager": eagle(head_dir), "eagle": eagle(head_dir)}
    specs = {n: spec for n, spec in specs.items() if n in rows}
    row_head = {"eagle_untrained": "untrained", "eagle_copy": "copy", "eagle_eager": "trained", "eagle": "trained"}
    reference = {}
    # replays run the heads in the engine's dtype (bf16 on GPU: what the engine runs) and, on GPU,
    # the trained one also in fp32 (what training ran, under autocast): a gap between the two = precision
    head_dirs = {"trained": head_dir, "untrained": f"{head_dir}/initial", "copy": f"{head_dir}/copy"}
    heads = {h: load_head(head_dirs[h], dtype=dtype, device=dev) for h in sorted({row_head[n] for n in specs
                                                                                 if n in row_head})}
    if dtype != torch.float32 and "trained" in heads:
        heads["trained_fp32"] = load_head(head_dir, device=dev)
    results["replay"] = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        eagle_module.GRAPHS = name != "eagle_eager"
        llm = LLM(hf, speculative_config=spec and dict(spec, adaptive=False), **engine_kw)  # every step drafts
        row = dict(startup_s=round(time.perf_counter() - t0, 1))
        for tail, prompts in tails.items():
            if name in ("eagle_untrained", "eagle_copy", "eagle_eager") and tail != comparison_tail:
                continue  # comparison rows: one tail is enough
            m0 = dict(llm.metrics)
            row[tail], tokens = timed(llm, prompts, tail_params, dev)
            steps = row[tail].get("spec_steps") or args.tail_tokens  # off: one decode step per token
            row[tail]["ms_per_step"] = round(1e3 * row[tail]["seconds"] / steps, 2)
            reference.setdefault(tail, tokens)
            row[tail]["same_tokens_as_off"] = tokens == reference[tail]
            if tokens != reference[tail]:
                row[tail]["divergence"] = divergence(hf, prompts, reference[tail], tokens)
            if name == "off":  # what a head must show in the engine on these very tokens
                results["replay"][tail] = {h: replay_rows(heads[h], hf, prompts, tokens, args.k) for h in heads}
                if "trained" in heads and args.train_len < args.tail_tokens:
                    results["replay"][f"{tail}_first_{args.train_len}"] = replay_rows(
                        heads["trained"], hf, prompts, tokens, args.k, upto=args.train_len)
            elif name in row_head:  # the engine vs its own tokens: equal unless the engine drafts wrong
                row[tail]["replay"] = replay_rows(heads[row_head[name]], hf, prompts, tokens, args.k)
            if "spec_steps" in row[tail]:  # (warm-up + timed run: the same greedy tokens twice)
                m = {n: (llm.metrics[f"spec_{n}"] - m0[f"spec_{n}"]) // 2 for n in ("rows", "draft_tokens",
                                                                                     "accepted_tokens")}
                passes = round((m["rows"] + m["accepted_tokens"]) / max(m["rows"], 1), 3)
                row[tail].update(rounds=m["rows"], drafted=m["draft_tokens"], accepted=m["accepted_tokens"],
                                 tokens_per_target_pass=passes)
        if name in ("off", "eagle") and args.a_batch:
            row["a"], _ = timed(llm, a_prompts, a_params, dev)
        if args.profile_rounds and spec is not None:
            rounds = args.profile_rounds
            row["profile"] = profile_rounds(llm, tails[comparison_tail], SamplingParams(
                temperature=0, max_tokens=min(args.tail_tokens, (rounds + 1) * (args.k + 1)), ignore_eos=True), rounds)
        results["rows"][name] = row
        print(name, json.dumps(row), flush=True)
        write_json(args.json, results)  # after every row: a later failure keeps what was measured
        llm.close()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    off = results["rows"]["off"]
    results["speedup"] = {f"{tail}/{n}": round(r[tail]["tokens_per_s"] / off[tail]["tokens_per_s"], 3)
                          for n, r in results["rows"].items() if n != "off" for tail in tails if tail in r}
    if "a" in off and "eagle" in results["rows"]:
        a_eagle = results["rows"]["eagle"]["a"]["tokens_per_s"]
        results["speedup"]["a/eagle"] = round(a_eagle / off["a"]["tokens_per_s"], 3)
    print(json.dumps(results["speedup"]), flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
