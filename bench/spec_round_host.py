"""What a speculative round does per proposer, on CPU (issue 23): host ms by phase, read-backs, ops.

Issue 23: on an H200 (bench/spec_trained_target.py, 8 rows x 2,048 greedy, k = 4, a 151,936-token
vocabulary, ``draft_sampling=probabilistic``) a draft-model or EAGLE round took 6.9 ms against
n-gram's 2.6 ms at the same acceptance. This runs one engine per proposer (ngram, draft_model: the
target's first layer, eagle: the copy head of spec_eagle.py) on the same 8 greedy rows of a random
target (``--shape mini-32k``: V = 32,768, so full-vocabulary work shows) and reports, per round
(rounds 3.. of the generation; a sequence's first rounds catch up eagerly):

  ms           host ms of the phase itself (sub-phases excluded); CPU, tiny model: the CPU
               computes what the GPU would, so ``ms`` of forward-heavy phases is compute
  ops          aten ops dispatched in the phase (eager on a GPU: one kernel launch each; inside
               a graph there: none). The GPU runs the draft rounds and the verify pass in graphs
               where it can, so compare ``vocab_ops``/``vocab_mb`` and ``readbacks`` across rows
  vocab_ops    ops whose output's last dimension is V (full-vocabulary kernels: most of a round's
               device time at V = 151,936 beyond the forwards), vocab_mb their output MB (as fp32)
  readbacks    Tensor.item / tolist / cpu / numpy / __bool__ / nonzero calls (on a GPU: a
               device->host sync each when the tensor lives there; on CPU every tensor counts,
               an upper bound)
  q_rounds     rounds whose proposer handed the verifier draft probabilities q ``[B, k, V]``
               (the verifier's probabilistic path; none with argmax drafts)

Phases: propose (catch_up: draft K/V or features of positions not drafted from), verify (tail: the
sampler + verifier; read_back: the result to host lists), verified, postprocess.

    PYTHONPATH=$PWD python bench/spec_round_host.py                    # this checkout
    PYTHONPATH=<other checkout> python bench/spec_round_host.py        # the same harness on other code
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import draft_from_target, repetitive_prompt  # noqa: E402
from spec_eagle import copy_head  # noqa: E402

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import SHAPES, build_random_hf  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402

READBACKS = ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")


class Recorder(TorchDispatchMode):
    """Attributes ops, vocab-sized ops and read-backs to the innermost open phase (``stack``)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.stack, self.on = vocab, [], False
        self.acc = defaultdict(lambda: defaultdict(float))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and self.stack:
            a = self.acc[self.stack[-1]]
            a["ops"] += 1
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.dim() and first.shape[-1] == self.vocab:
                a["vocab_ops"] += 1
                a["vocab_mb"] += first.numel() * 4 / 1e6
        return out

    def phase(self, name: str, fn):
        def wrapped(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            parent = self.stack[-1] if self.stack else None
            self.stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = 1e3 * (time.perf_counter() - t0)
                self.stack.pop()
                self.acc[name]["ms"] += dt
                if parent is not None:
                    self.acc[parent]["ms"] -= dt  # exclusive times
        return wrapped

    def count_readbacks(self) -> None:
        for m in READBACKS:
            orig = getattr(torch.Tensor, m)

            def counting(t, *a, _orig=orig, **kw):
                if self.on and self.stack:
                    self.acc[self.stack[-1]]["readbacks"] += 1
                return _orig(t, *a, **kw)
            setattr(torch.Tensor, m, counting)


def round_costs(llm, prompts, params, vocab: int, skip: int = 2) -> dict:
    """Per-round averages of every phase over one generation (rounds ``skip + 1``..)."""
    spec, rec = llm.spec, Recorder(vocab)
    p, v = spec.proposer, spec.verify_step
    for obj, attr, name in ((p, "propose", "propose"), (p, "_catch_up", "propose.catch_up"), (v, "run", "verify"),
                            (v, "_tail", "verify.tail"), (v, "_read_back", "verify.read_back"),
                            (v, "_unpack", "verify.read_back"), (p, "verified", "verified"),
                            (llm.scheduler, "postprocess_verify", "postprocess")):
        if hasattr(obj, attr):
            setattr(obj, attr, rec.phase(name, getattr(obj, attr)))
    state = {"round": 0, "rounds": 0, "q": 0}
    step, propose = spec.step, p.propose

    def counted_step(scheduler, version):
        state["round"] += 1
        rec.on = state["round"] > skip
        state["rounds"] += rec.on
        return step(scheduler, version)

    def noting_q(batch, budgets):
        out = propose(batch, budgets)
        state["q"] += rec.on and out[2] is not None
        return out

    spec.step, p.propose = counted_step, noting_q
    rec.count_readbacks()
    saved = {m: getattr(torch.Tensor, m) for m in READBACKS}
    try:
        with rec:
            llm.generate(prompts, params)
    finally:
        rec.on = False
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)
    n = max(state["rounds"], 1)
    phases = {name: {k: round(val / n, 3 if k in ("ms", "vocab_mb") else 1) for k, val in sorted(a.items())}
              for name, a in sorted(rec.acc.items())}
    total = {k: round(sum(a.get(k, 0.0) for a in rec.acc.values()) / n, 3)
             for k in ("ms", "ops", "vocab_ops", "vocab_mb", "readbacks")}
    return dict(rounds=state["rounds"], q_rounds=state["q"], per_round=total, phases=phases)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mini-32k", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per row")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-sampling", default="probabilistic", choices=("greedy", "probabilistic"),
                    help="the proposers' config (spec_trained_target.py's default: probabilistic)")
    ap.add_argument("--proposers", default="ngram,draft_model,eagle")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hf = build_random_hf(args.shape, torch.float32, "cpu", 512)
    vocab = hf.config.vocab_size
    head_dir = tempfile.mkdtemp(prefix="eagle_copy_")
    copy_head(hf).save(head_dir)
    specs = {"ngram": {"method": "ngram"},
             "draft_model": {"method": "draft_model", "model": draft_from_target(hf, 1),
                             "draft_sampling": args.draft_sampling},
             "eagle": {"method": "eagle", "model": head_dir, "draft_sampling": args.draft_sampling}}
    prompts = [repetitive_prompt(vocab, seed=0, offset=i) for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    out = dict(shape=args.shape, vocab=vocab, batch=args.batch, k=args.k, tokens=args.tokens,
               draft_sampling=args.draft_sampling, rows={})
    reference = LLM(hf, device="cpu", dtype=torch.float32, max_model_len=512, block_size=16).generate(prompts, params)
    reference = [list(c.token_ids) for o in reference for c in o.outputs]
    for name in args.proposers.split(","):
        llm = LLM(hf, device="cpu", dtype=torch.float32, max_model_len=512, block_size=16,
                  speculative_config=dict(specs[name], num_speculative_tokens=args.k, adaptive=False))
        llm.generate(prompts, params)  # warm-up
        row = round_costs(llm, prompts, params, vocab)
        tokens = [list(c.token_ids) for o in llm.generate(prompts, params) for c in o.outputs]
        row["same_tokens_as_off"] = tokens == reference
        m = llm.metrics
        row["acceptance_rate"], row["tokens_per_target_pass"] = m["spec_acceptance_rate"], m["spec_tokens_per_target_pass"]
        out["rows"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
