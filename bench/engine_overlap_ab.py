"""Overlapped vs step-by-step scheduling on ONE warm engine, alternating runs of workload
a (256 x (256 in, 256 out), EOS ignored; Qwen3-0.6B shape, random weights, bf16), so
first-run costs (kernel plans, allocator, compile caches) fall on neither mode alone.

    python bench/engine_overlap_ab.py [--order 0,1,0,1,1,0]
"""
import argparse
import json

import torch

from asyncrl.engine import LLM
from asyncrl.engine.bench import _rand_prompts, build_random_hf, run_engine
from asyncrl.types import SamplingParams

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="0,1,0,1,1,0", help="1 = overlapped, 0 = step by step")
    args = ap.parse_args()
    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    llm = LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512,
              max_num_batched_tokens=16384, max_model_len=4096, gpu_memory_utilization=0.6)
    llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    prompts = _rand_prompts(256, 256, 151936, 1)
    params = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True)
    for i, overlap in enumerate(bool(int(x)) for x in args.order.split(",")):
        llm.async_scheduling = overlap  # between generate calls nothing is in flight
        llm.block_manager.set_namespace(llm.block_manager.namespace)  # no prefix-cache hits
        r = run_engine(llm, prompts, params, "cuda")
        print(json.dumps(dict(run=i, overlap=overlap, tokens_per_s=r["tokens_per_s"], seconds=r["seconds"])),
              flush=True)
