"""Prefill attention end to end: FlashAttention-2's varlen kernel vs the padded, masked SDPA path.

The gathered path (prefill) used to pad a step's prompts to the longest, repeat K/V per query head and
run a masked memory-efficient SDPA over the full square; on an H200 workload (c)'s prefill (prompts of
100-1,024 tokens) then ran at 163k tok/s against 455k for (a)'s equal prompts (bench/decode_timeline.py's
step mix, session 46). ``attention.VARLEN_PREFILL`` switches the packed varlen path (``varlen_attention``)
on or off in one engine; this runs ``asyncrl bench rollout``'s workloads (a) and (c), and (c)'s prompts
with one new token each (prefill alone: prompt tok/s), interleaved off / on, and prints the medians. GPU only.

    python bench/prefill_varlen_ab.py --json out.json   # ~2 min on an H200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import attention  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402


def workloads(vocab: int) -> dict:
    from asyncrl.engine.bench import workload_a, workload_c
    from asyncrl.types import SamplingParams

    c = workload_c(vocab)
    c_prefill = (c[0], SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True))
    return {"a": workload_a(vocab), "c": c, "c_prefill": c_prefill}


def run(repeats: int, kv: str | None) -> dict:
    from asyncrl.engine import LLM
    from asyncrl.engine.bench import build_random_hf, run_engine

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    llm = LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, gpu_memory_utilization=0.6, kv_cache_dtype=kv)
    loads = workloads(hf.config.vocab_size)
    runs = {w: {"padded": [], "varlen": []} for w in loads}
    for _ in range(repeats):
        for w, (prompts, params) in loads.items():
            for name, on in (("padded", False), ("varlen", True)):
                attention.VARLEN_PREFILL = on
                r = run_engine(llm, prompts, params, "cuda")
                rate = r["prefill_tokens"] / r["seconds"] if w == "c_prefill" else r["tokens_per_s"]
                runs[w][name].append(round(rate, 1))
                print(w, name, round(rate, 1), "(prompt tok/s)" if w == "c_prefill" else "tok/s", flush=True)
    attention.VARLEN_PREFILL = True
    out = {}
    for w, by in runs.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        out[w] = dict(runs=by, median=med, varlen_over_padded=round(med["varlen"] / med["padded"], 3))
        print(w, json.dumps(out[w]), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default=None, choices=("fp8",))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = provenance("python bench/prefill_varlen_ab.py " + " ".join(sys.argv[1:]))
    out["engine"] = run(args.repeats, args.kv_cache_dtype)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
