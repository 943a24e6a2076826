"""Graph inputs by kernel vs by copy-engine memcpys: workloads (a) and (c) end to end.

Each graphed decode step copies its inputs (ids, positions, slots, block tables, context lengths, and the
sampler's temperatures and keys) from the step's staging buffer into the CUDA graph's fixed buffers. One
``copy_`` each is a copy-engine memcpy; on the H200 the kernel after such a memcpy started 20-40 us after it
ended, every step (bench/decode_timeline.py, 2026-12-04: ~0.21 ms idle per (c) decode step).
``model_runner.KERNEL_INPUT_COPIES`` groups them into one multi-tensor kernel per dtype
(``torch._foreach_copy_``). The copies run outside the graphs, so one engine serves both settings: this times
``asyncrl bench rollout``'s workloads (a) and (c) in interleaved repeats after an untimed run of each
(``engine.bench.interleaved_ab``). GPU only.

    python bench/graph_inputs_ab.py --json out.json   # ~1.5 min on an H200
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

from asyncrl.engine import model_runner  # noqa: E402


def run(repeats: int, kv: str | None) -> dict:
    from asyncrl.engine import LLM
    from asyncrl.engine.bench import build_random_hf, interleaved_ab, workload_a, workload_c

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    vocab = hf.config.vocab_size
    loads = {"a": workload_a(vocab), "c": workload_c(vocab)}
    llm = functools.cache(lambda: LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512,
                                      max_num_batched_tokens=16384, max_model_len=4096, gpu_memory_utilization=0.6,
                                      kv_cache_dtype=kv))
    variants = {"memcpy": functools.partial(setattr, model_runner, "KERNEL_INPUT_COPIES", False),
                "kernel": functools.partial(setattr, model_runner, "KERNEL_INPUT_COPIES", True)}
    try:
        return interleaved_ab(llm, variants, loads, repeats)
    finally:
        model_runner.KERNEL_INPUT_COPIES = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default=None, choices=("fp8",))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__, command="python bench/graph_inputs_ab.py " + " ".join(sys.argv[1:]),
               engine=run(args.repeats, args.kv_cache_dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
