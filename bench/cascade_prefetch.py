"""Block ids prefetched a tile ahead in the cascade (shared-prefix) kernels: on vs off, bf16 and e4m3 caches.

``CascadeLaunchRule.suffix_prefetch`` (the suffix decode) and ``prefix_prefetch`` (the prefix kernel):
2 = on every cache, 1 = on e4m3 caches, 0 = off. GPU only.

1. Kernels, per shape of ``bench/cascade_decode.py`` (peer: the GRPO rollout of the issue-20 bench,
   16 groups x 8, prefix 256, batch 128; b: workload (b), 32 groups x 16, prefix 1,024, batch 512) at
   each suffix length and cache dtype: the full cascade (prefix + suffix kernels, the default rule's
   chunks and tiles) with both prefetches off, suffix only, prefix only and both, GPU time per layer
   (one CUDA graph over 4 layers' caches); each output's max abs difference to plain paged decode.
2. Engine (``--engine``): workload (b) (GRPO 32 x 16, prompt 1,024, response 128) on bf16 and FP8 KV
   caches, the rule's prefetches off vs the default rule (suffix on e4m3, prefix on every cache), one
   engine each (3,072 KV blocks), interleaved repeats.

    python bench/cascade_prefetch.py --json out.json            # kernels, ~1 min
    python bench/cascade_prefetch.py --engine --json out.json   # + engine, ~3 min
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cascade_decode import D, H, HKV, PAGE, SHAPES, kernel_case, per_layer_us  # noqa: E402

from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.cascade import CascadeLaunchRule  # noqa: E402

DEFAULT = CascadeLaunchRule()
RULES = {  # name -> the rule (the default's chunks and tiles, prefetches as named)
    "off": dataclasses.replace(DEFAULT, suffix_prefetch=0, prefix_prefetch=0),
    "suffix": dataclasses.replace(DEFAULT, suffix_prefetch=2, prefix_prefetch=0),
    "prefix": dataclasses.replace(DEFAULT, suffix_prefetch=0, prefix_prefetch=2),
    "both": dataclasses.replace(DEFAULT, suffix_prefetch=2, prefix_prefetch=2),
}
ENGINE_RULES = {"off": RULES["off"], "default": DEFAULT}  # default: suffix on e4m3, prefix on every cache
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def kernel_rows(shape_name: str, kv: str) -> list[dict]:
    from asyncrl.engine import triton_decode as td
    from asyncrl.engine.cascade import plan_cascade, prefix_splits_for, tile_shape

    shape = SHAPES[shape_name]
    rows = []
    for suffix in shape["suffixes"]:
        q, kc, vc, bt_np, ctx_np = kernel_case(suffix, shape["groups"], shape["n"], shape["prefix"])
        kc, vc = kc.to(KV_DTYPES[kv]), vc.to(KV_DTYPES[kv])
        B = q.shape[0]
        plan = plan_cascade(bt_np, ctx_np, PAGE, tile_shape(H // HKV)[1], bs=B)
        plan.prefix_splits = prefix_splits_for(plan.num_tiles, HKV, shape["prefix"], td.num_sms(q.device), DEFAULT)
        packed = torch.from_numpy(plan.packed()).cuda()
        sfx, tiles = packed[:B], packed[B:].view(-1, 2 + tile_shape(H // HKV)[1])
        bt, ctx = torch.from_numpy(bt_np).cuda(), torch.from_numpy(ctx_np).cuda()
        plain = td.paged_decode_attention(q, kc[0], vc[0], bt, ctx, D ** -0.5)
        row = dict(shape=shape_name, kv=kv, suffix=suffix, batch=B, prefix_chunks=plan.prefix_splits,
                   plain_us=per_layer_us(lambda i: td.paged_decode_attention(q, kc[i], vc[i], bt, ctx, D ** -0.5)))
        for name, rule in RULES.items():
            f = lambda i, rule=rule: td.cascade_decode_attention(q, kc[i], vc[i], bt, ctx, sfx, tiles,  # noqa: E731
                                                                 D ** -0.5, rule=rule)
            row[f"{name}_us"] = per_layer_us(f)
            row[f"{name}_diff"] = float(f"{(f(0).float() - plain.float()).abs().max().item():.3g}")
        for name in ("suffix", "prefix", "both"):
            row[f"{name}_x"] = round(row["off_us"] / row[f"{name}_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def engine_rows(repeats: int) -> dict:
    from asyncrl.engine import LLM
    from asyncrl.engine import cascade as cm
    from asyncrl.engine.bench import _free, _rand_prompts, build_random_hf, run_engine
    from asyncrl.types import SamplingParams

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    kw = dict(dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, num_kv_blocks=3072)  # two engines at once: a fixed pool each
    params = SamplingParams(n=16, temperature=1.0, max_tokens=128, ignore_eos=True)
    seeds = iter(range(300, 400))
    out = {}
    for kv in ("bf16", "fp8"):
        engines = {}
        for name in ("off", "default"):
            cm.CASCADE_RULE = ENGINE_RULES[name]  # read when the engine captures its graphs and launches kernels
            llm = LLM(hf, **kw, **({"kv_cache_dtype": "fp8"} if kv == "fp8" else {}))
            llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
            engines[name] = llm
        runs = {name: [] for name in engines}
        for _ in range(repeats):
            prompts = _rand_prompts(32, 1024, hf.config.vocab_size, next(seeds))
            for name, llm in engines.items():
                cm.CASCADE_RULE = ENGINE_RULES[name]
                runs[name].append(run_engine(llm, prompts, params, "cuda")["tokens_per_s"])
                print(kv, name, runs[name][-1], flush=True)
        for llm in engines.values():
            _free(llm)
        med = {name: statistics.median(v) for name, v in runs.items()}
        out[kv] = dict(tokens_per_s=runs, median=med, on_over_off=round(med["default"] / med["off"], 3))
        print(kv, json.dumps(out[kv]), flush=True)
    cm.CASCADE_RULE = DEFAULT
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", default="peer,b")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    out = dict(provenance(" ".join(sys.argv)), rows=[])
    for shape in args.shape.split(","):
        for kv in KV_DTYPES:
            out["rows"].extend(kernel_rows(shape, kv))
    sums = {}
    for r in out["rows"]:
        key = f"{r['shape']} {r['kv']}"
        for name in RULES:
            sums.setdefault(key, {}).setdefault(name, 0.0)
            sums[key][name] += r[f"{name}_us"]
    out["summed_us"] = {k: {n: round(v, 1) for n, v in d.items()} for k, d in sums.items()}
    for key, d in sums.items():
        print(f"{key}: summed us off {d['off']:.1f}, suffix {d['off'] / d['suffix']:.3f}x, prefix "
              f"{d['off'] / d['prefix']:.3f}x, both {d['off'] / d['both']:.3f}x", flush=True)
    print(f"kernels: {time.time() - t0:.0f} s", flush=True)
    if args.engine:
        out["engine_b"] = engine_rows(args.repeats)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
