"""The sampler's tile noise bound end to end: workloads (a) and (c), bound off vs on.

The one-pass sampler (``triton_sampler._partial_kernel``) skips the Gumbel noise of vocab tiles that cannot
win the race. Its first test bounds the noise by its largest possible value, which a trained LM's peaked
logits pass on most tiles but a random-weight model's flat logits never (session 45's profile: 0.20 ms of
a 4-5 ms decode step of (a) in the sampler). The second test (``triton_sampler.TILE_NOISE_BOUND``) bounds a
tile's noise by its own largest uniform (two scalar logs), so only tiles that may hold the winner pay the
logs and the division. This times ``asyncrl bench rollout``'s workloads (a) and (c) with one engine per
setting (its decode graphs capture the sampler), interleaved repeats after an untimed run of each
(``engine.bench.interleaved_ab``). Tokens are the same either way (only skipped tiles differ). GPU only.

    python bench/sampler_ab.py --json out.json            # ~2 min on an H200
    python bench/sampler_ab.py --kv bf16,fp8 --repeats 2
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import triton_sampler as ts  # noqa: E402

FLAG = os.environ.get("SAMPLER_AB_FLAG", "PREFETCH_TILES")
DEFAULT = getattr(ts, FLAG)


def run(repeats: int, kv_dtypes: list[str], blocks: int) -> dict:
    from asyncrl.engine import LLM
    from asyncrl.engine.bench import build_random_hf, interleaved_ab, workload_a, workload_c

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    kw = dict(dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, num_kv_blocks=blocks)
    vocab = hf.config.vocab_size
    loads = {"a": workload_a(vocab), "c": workload_c(vocab)}
    variants = {"off": functools.partial(setattr, ts, FLAG, False), "on": functools.partial(setattr, ts, FLAG, True)}
    out = {}
    try:
        for kv in kv_dtypes:
            print("kv", kv, flush=True)
            fp8 = {"kv_cache_dtype": "fp8"} if kv == "fp8" else {}
            out[kv] = interleaved_ab(lambda: LLM(hf, **kw, **fp8), variants, loads, repeats)
    finally:
        setattr(ts, FLAG, DEFAULT)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="bf16", help="KV cache dtypes, comma-separated: bf16, fp8")
    ap.add_argument("--blocks", type=int, default=6000, help="KV blocks per engine (both engines are held at once)")
    args = ap.parse_args()
    out = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__, command="python bench/sampler_ab.py " + " ".join(sys.argv[1:]),
               engine=run(args.repeats, args.kv.split(","), args.blocks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
