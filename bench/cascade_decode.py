"""Cascade (shared-prefix) decode attention vs plain paged decode, GPU.

1. Kernel microbenchmark at workload (b)'s shape: 32 groups x 16 samples, prefix 1024
   (shared full blocks), per-sample suffix S in {1, 64, 128}, Qwen3-0.6B attention
   (16 q heads, 8 kv heads, D 128), block 64, bf16, one layer; blocks scattered at random.
   Times plain ``paged_decode_attention`` and ``cascade_decode_attention`` (triton
   ``do_bench``, median) for several prefix launch shapes (splits x persistent programs
   per SM), the suffix kernel alone, the host planning time, and the max abs difference.
   The fastest shape at suffix 64 is used for part 2 (``pick_variant``).
2. Engine, workload (b) (``asyncrl bench rollout``'s, engine only): prefix sharing on with
   cascade, sharing on with the plain kernel (cascade toggled off in the same engine),
   and sharing off; interleaved repeats, medians.

    python bench/cascade_decode.py --json out.json [--skip-engine] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import numpy as np
import torch


def kernel_case(suffix: int, groups=32, n=16, prefix=1024, page=64, H=16, Hkv=8, D=128, dtype=torch.bfloat16, seed=0):
    """Random paged KV where each group's members share ``prefix // page`` blocks."""
    g = np.random.default_rng(seed)
    B = groups * n
    pb, sb = prefix // page, -(-suffix // page)
    nb = groups * pb + B * sb
    ids = g.permutation(nb)
    shared = ids[: groups * pb].reshape(groups, pb)
    own = ids[groups * pb:].reshape(B, sb)
    bt = np.concatenate([np.repeat(shared, n, 0), own], 1).astype(np.int32)
    ctx = np.full(B, prefix + suffix, dtype=np.int32)
    dev = torch.device("cuda")
    kc = torch.randn(nb + 1, page, Hkv, D, device=dev, dtype=dtype)
    vc = torch.randn(nb + 1, page, Hkv, D, device=dev, dtype=dtype)
    q = torch.randn(B, H, D, device=dev, dtype=dtype)
    return q, kc, vc, bt, ctx


def microbench(suffixes=(1, 64, 128), variants=((1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8))) -> list[dict]:
    """variants: (prefix splits, persistent programs per SM)."""
    from triton.testing import do_bench

    from asyncrl.engine import triton_decode as td
    from asyncrl.engine.cascade import plan_cascade, tile_shape

    rows = []
    for s in suffixes:
        q, kc, vc, bt_np, ctx_np = kernel_case(s)
        B, H, D = q.shape
        hkv, page = kc.shape[2], kc.shape[1]
        _, mpt = tile_shape(H // hkv)
        t0 = time.perf_counter()
        for _ in range(20):
            plan = plan_cascade(bt_np, ctx_np, page, mpt, bs=B)
        plan_us = (time.perf_counter() - t0) / 20 * 1e6
        packed = torch.from_numpy(plan.packed()).cuda()
        sfx, tiles = packed[:B], packed[B:].view(-1, 2 + mpt)
        bt, ctx = torch.from_numpy(bt_np).cuda(), torch.from_numpy(ctx_np).cuda()
        scale = D ** -0.5
        plain = td.paged_decode_attention(q, kc, vc, bt, ctx, scale)
        bench = lambda f: do_bench(f, warmup=25, rep=150, return_mode="median")  # noqa: E731
        t_plain = bench(lambda: td.paged_decode_attention(q, kc, vc, bt, ctx, scale))
        kv_tok = 2 * hkv * D * q.element_size()
        unique = (32 * 1024 + B * s) * kv_tok
        logical = B * (1024 + s) * kv_tok
        row = dict(suffix=s, batch=B, plan_host_us=round(plan_us, 1), tiles=plan.num_tiles,
                   plain_us=round(t_plain * 1000, 1), plain_logical_TBps=round(logical / t_plain / 1e9, 2),
                   unique_MB=round(unique / 1e6, 1), logical_MB=round(logical / 1e6, 1), cascade={})
        for sp, per_sm in variants:
            f = lambda: td.cascade_decode_attention(q, kc, vc, bt, ctx, sfx, tiles, scale, splits=sp,  # noqa: E731
                                                    programs_per_sm=per_sm)
            out = f()
            t = bench(f)
            po = torch.zeros(sp, B, H, D, dtype=q.dtype, device=q.device)
            pl = torch.zeros(sp, B, H, dtype=torch.float32, device=q.device)
            t_sfx = bench(lambda: td._launch_decode(q, kc, vc, torch.empty_like(q), bt, ctx, scale,
                                                    cascade=(sfx, po, pl)))
            row["cascade"][f"splits{sp}_p{per_sm}"] = dict(
                us=round(t * 1000, 1), suffix_kernel_us=round(t_sfx * 1000, 1), speedup=round(t_plain / t, 2),
                unique_TBps=round(unique / t / 1e9, 2),
                max_abs_diff=round((out.float() - plain.float()).abs().max().item(), 5))
        rows.append(row)
        print("kernel", json.dumps(row), flush=True)
    return rows


def pick_variant(rows: list[dict], suffix: int = 64) -> tuple[int, int]:
    """(splits, programs per SM) of the fastest cascade at ``suffix``; sets the engine's."""
    from asyncrl.engine import triton_decode as td

    row = next(r for r in rows if r["suffix"] == suffix)
    name = min(row["cascade"], key=lambda k: row["cascade"][k]["us"])
    sp, per_sm = (int(x) for x in name.replace("splits", "").split("_p"))
    td.PREFIX_SPLITS, td.PREFIX_PROGRAMS_PER_SM = sp, per_sm
    return sp, per_sm


def engine_b(repeats: int) -> dict:
    from asyncrl.engine import LLM
    from asyncrl.engine.bench import _free, _rand_prompts, build_random_hf, run_engine
    from asyncrl.types import SamplingParams

    dev = "cuda"
    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, dev, 4096)
    kw = dict(dtype=torch.bfloat16, device=dev, block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, gpu_memory_utilization=0.6)
    seeds = iter(range(100, 200))  # fresh prompts every run: no prefix-cache hits across runs
    params = SamplingParams(n=16, temperature=1.0, max_tokens=128, ignore_eos=True)

    def make(**extra):
        t0 = time.perf_counter()
        llm = LLM(hf, **{**kw, **extra})
        llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
        return llm, round(time.perf_counter() - t0, 1)

    res = dict(cascade_on=[], cascade_off=[], sharing_off=[])
    llm, res["startup_s_sharing_on"] = make()
    for _ in range(repeats):
        for key, enabled in (("cascade_on", True), ("cascade_off", False)):
            llm.runner.cascade.enabled = enabled
            steps0 = llm.runner.cascade.steps
            prompts = _rand_prompts(32, 1024, hf.config.vocab_size, next(seeds))
            r = run_engine(llm, prompts, params, dev)
            r["cascade_steps"] = llm.runner.cascade.steps - steps0
            res[key].append(r)
            print(key, json.dumps(r), flush=True)
    _free(llm)
    off, res["startup_s_sharing_off"] = make(enable_fork=False, enable_prefix_caching=False, cascade_attention=False)
    for _ in range(max(1, repeats - 1)):
        r = run_engine(off, _rand_prompts(32, 1024, hf.config.vocab_size, next(seeds)), params, dev)
        res["sharing_off"].append(r)
        print("sharing_off", json.dumps(r), flush=True)
    _free(off)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in res.items() if isinstance(v, list)}
    res["median_tokens_per_s"] = med
    res["sharing_on_off_cascade"] = round(med["cascade_on"] / med["sharing_off"], 2)
    res["sharing_on_off_plain"] = round(med["cascade_off"] / med["sharing_off"], 2)
    res["cascade_vs_plain"] = round(med["cascade_on"] / med["cascade_off"], 2)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    out = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
               torch=torch.__version__)
    if not args.skip_kernel:
        out["kernel"] = microbench()
        out["picked_splits_programs_per_sm"] = pick_variant(out["kernel"])
        print("picked", out["picked_splits_programs_per_sm"], flush=True)
    if not args.skip_engine:
        out["engine_b"] = engine_b(args.repeats)
        print("engine_b", json.dumps({k: v for k, v in out["engine_b"].items() if not isinstance(v, list)}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
