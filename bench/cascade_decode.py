"""Cascade (shared-prefix) decode attention vs plain paged decode, GPU (issues 4, 20, 23).

1. Kernel sweep, per shape (``--shape``, comma-separated; default ``b``):
     b:    workload (b): 32 groups x 16 samples, prefix 1,024, suffix S in {1, 64, 128};
     peer: the GRPO rollout of the issue-20 bench: 16 groups x 8, prefix 256, S in {1, 64, 128, 256}.
   Qwen3-0.6B attention (16 q / 8 kv heads, D 128), block 64, bf16, blocks scattered at random.
   Each timing is one CUDA graph of the call over ``LAYER_COPIES`` separate K/V caches (as the
   engine's layers: the next call's K/V is not in L2), GPU time per layer in us
   (``triton.testing.do_bench_cudagraph``, median). Reported, with the max abs difference to the
   plain kernel's output for every variant:
     * plain paged decode (the engine's ``DECODE_LAUNCH``) at each S;
     * prefix sweep (the prefix kernel alone, and prefix + default suffix at the first S):
       chunks per prefix x persistent programs per SM x (BLOCK_N, warps);
     * suffix sweep at each S (the suffix kernel alone, merging a 1-chunk prefix): block_n /
       warps / stages, split-KV 2 / 4, prefix part 0 loaded before the loop (``early``), block
       table in registers, the packed variant;
     * full cascade at each S: ``today`` = the launch before the 2026-12-02 sweep (``BEFORE``: 1
       chunk, the plain decode's suffix tile; the sweep's base), the rule (``prefix_fill``) at each
       candidate fill, the best prefix + best suffix variant, ``defaults`` (``CascadeLaunchRule()``,
       now the sweep's pick) and the process's ``ASYNCRL_CASCADE_LAUNCH`` (``configured``).
   Last lines: the fill whose summed time over all shapes and S is lowest (relative to ``today``),
   the best prefix and suffix launches, and the ``ASYNCRL_CASCADE_LAUNCH`` they make.
2. Engine, workload (b) only (``asyncrl bench rollout``'s, engine only): prefix sharing on with
   cascade, sharing on with the plain kernel (cascade toggled off in the same engine), and
   sharing off; interleaved repeats, medians. Skipped unless the shapes include ``b``.

    python bench/cascade_decode.py --shape peer,b --skip-engine --json out.json   # sweep, ~2 min
    python bench/cascade_decode.py --json out.json [--skip-engine] [--repeats 2]  # (b) + engine
    python bench/cascade_decode.py --offline   # no GPU: sm90 registers / shared memory of each launch
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

from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.cascade import CascadeLaunchRule  # noqa: E402

SHAPES = {"b": dict(groups=32, n=16, prefix=1024, suffixes=(1, 64, 128)),
          "peer": dict(groups=16, n=8, prefix=256, suffixes=(1, 64, 128, 256))}
H, HKV, D, PAGE = 16, 8, 128, 64
LAYER_COPIES = 4  # K/V caches cycled through in one timed graph (> L2 together)
REP_MS = 20  # per timing: ~0.2 s with graph capture (about 260 timings for peer,b)
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU dry run (TRITON_INTERPRET=1) sets "cpu", float32
TOL = 2e-2  # bf16: a variant further than this from plain is wrong (reported, never picked)
PREFIX_TILES = ((64, 4), (32, 4), (64, 8))  # (BLOCK_N, warps) of the prefix kernel
PREFIX_PROGRAMS = (2, 4, 8)
PREFIX_CHUNKS = (1, 2, 4, 8)
FILLS = (0.0, 0.5, 1.0, 2.0, 4.0)
SUFFIX_VARIANTS = {  # name -> (rule fields of the suffix, a DecodeLaunch override or None)
    "default": ({}, None),
    "n32": (dict(suffix_block_n=32), None),
    "n16 w2": (dict(suffix_block_n=16, suffix_warps=2), None),
    "n64 s2": (dict(suffix_stages=2), None),
    "n64 w8": (dict(suffix_warps=8), None),
    "kv2": (dict(suffix_kv_splits=2), None),
    "kv4": (dict(suffix_kv_splits=4), None),
    "n32 kv4": (dict(suffix_block_n=32, suffix_kv_splits=4), None),
    "early": (dict(suffix_early_prefix=1), None),
    "early n32": (dict(suffix_early_prefix=1, suffix_block_n=32), None),
    "table regs": ({}, "table"),
    "packed": ({}, "packed"),
}


def kernel_case(suffix: int, groups=32, n=16, prefix=1024, page=None, Hq=None, Hkv=None, Dh=None, copies=None,
                dtype=None, seed=0):
    """Random paged KV where each group's members share ``prefix // page`` blocks; ``copies``
    caches ``[copies, N, page, Hkv, D]`` with the same tables (as an engine's layers)."""
    page, Hq, Hkv, Dh = page or PAGE, Hq or H, Hkv or HKV, Dh or D
    copies, dtype = copies or LAYER_COPIES, dtype or DTYPE
    g = np.random.default_rng(seed)
    B = groups * n
    pb, sb = prefix // page, -(-suffix // page)
    nb = groups * pb + B * sb
    ids = g.permutation(nb)
    shared = ids[: groups * pb].reshape(groups, pb)
    own = ids[groups * pb:].reshape(B, sb)
    bt = np.concatenate([np.repeat(shared, n, 0), own], 1).astype(np.int32)
    ctx = np.full(B, prefix + suffix, dtype=np.int32)
    dev = torch.device(DEVICE)
    kc = torch.randn(copies, nb + 1, page, Hkv, Dh, device=dev, dtype=dtype)
    vc = torch.randn(copies, nb + 1, page, Hkv, Dh, device=dev, dtype=dtype)
    q = torch.randn(B, Hq, Dh, device=dev, dtype=dtype)
    return q, kc, vc, bt, ctx


def per_layer_us(fn) -> float:
    """GPU time of ``fn(layer)`` per layer: one CUDA graph over the ``LAYER_COPIES`` caches."""
    from triton.testing import do_bench_cudagraph

    t = do_bench_cudagraph(lambda: [fn(i) for i in range(LAYER_COPIES)], rep=REP_MS, return_mode="median")
    return round(t * 1000 / LAYER_COPIES, 2)


def suffix_launch(name: str):
    """(rule fields, DecodeLaunch or None) of suffix variant ``name``."""
    from asyncrl.engine.triton_decode import DECODE_LAUNCH, PACKED_LAUNCH

    fields, special = SUFFIX_VARIANTS[name]
    launch = {None: None, "table": dataclasses.replace(DECODE_LAUNCH, table_in_registers=True),
              "packed": PACKED_LAUNCH}[special]
    return fields, launch


class Case:
    """One shape at one suffix length on the GPU: inputs, the plan, plain output and timing."""

    def __init__(self, shape: dict, suffix: int):
        from asyncrl.engine import triton_decode as td
        from asyncrl.engine.cascade import plan_cascade, tile_shape

        q, kc, vc, bt_np, ctx_np = kernel_case(suffix, shape["groups"], shape["n"], shape["prefix"])
        self.q, self.kc, self.vc = q, kc, vc
        B = q.shape[0]
        _, mpt = tile_shape(H // HKV)
        t0 = time.perf_counter()
        for _ in range(20):
            self.plan = plan_cascade(bt_np, ctx_np, PAGE, mpt, bs=B)
        self.plan_us = (time.perf_counter() - t0) / 20 * 1e6
        packed = torch.from_numpy(self.plan.packed()).to(DEVICE)
        self.sfx, self.tiles = packed[:B], packed[B:].view(-1, 2 + mpt)
        self.bt, self.ctx = torch.from_numpy(bt_np).to(DEVICE), torch.from_numpy(ctx_np).to(DEVICE)
        self.scale = D ** -0.5
        self.plain = td.paged_decode_attention(q, kc[0], vc[0], self.bt, self.ctx, self.scale)
        self.plain_us = per_layer_us(lambda i: td.paged_decode_attention(q, kc[i], vc[i], self.bt, self.ctx,
                                                                         self.scale))

    def set_chunks(self, chunks: int) -> None:
        self.tiles[0, 1] = chunks  # the header's prefix chunk count, read by the kernels on the device

    def diff(self, out: torch.Tensor) -> float:
        return float(f"{(out.float() - self.plain.float()).abs().max().item():.3g}")

    def cascade(self, rule: CascadeLaunchRule, launch=None) -> dict:
        """Full cascade (prefix + suffix) at the header's current chunk count."""
        from asyncrl.engine import triton_decode as td

        f = lambda i: td.cascade_decode_attention(self.q, self.kc[i], self.vc[i], self.bt, self.ctx,  # noqa: E731
                                                  self.sfx, self.tiles, self.scale, rule=rule, launch=launch)
        us = per_layer_us(f)
        return dict(us=us, speedup=round(self.plain_us / us, 3), max_abs_diff=self.diff(f(0)))

    def prefix_alone(self, rule: CascadeLaunchRule) -> float:
        from asyncrl.engine import triton_decode as td

        return per_layer_us(lambda i: td.launch_prefix(self.q, self.kc[i], self.vc[i], self.bt, self.tiles,
                                                       self.scale, rule))

    def suffix_alone(self, rule: CascadeLaunchRule, launch=None) -> dict:
        from asyncrl.engine import triton_decode as td

        partials = [td.launch_prefix(self.q, self.kc[i], self.vc[i], self.bt, self.tiles, self.scale, rule)
                    for i in range(LAYER_COPIES)]
        f = lambda i: td.launch_suffix(self.q, self.kc[i], self.vc[i], self.bt, self.ctx, self.sfx,  # noqa: E731
                                       self.tiles, self.scale, partials[i], rule, launch)
        return dict(us=per_layer_us(f), max_abs_diff=self.diff(f(0)))


# The sweep's base: the launch before the 2026-12-02 pick (1 prefix chunk, the plain decode's suffix
# tile at every batch size), so each variant is measured against the same thing as in that sweep.
BEFORE = CascadeLaunchRule(prefix_fill=0.0, max_prefix_splits=8, small_batch_rows=0)


def prefix_rule(chunks: int, programs: int, block_n: int, warps: int, **suffix) -> CascadeLaunchRule:
    """A rule whose partials hold ``chunks`` (the header says how many are used)."""
    return dataclasses.replace(BEFORE, prefix_fill=1.0 if chunks > 1 else 0.0, max_prefix_splits=chunks,
                             min_chunk_tokens=block_n, prefix_programs_per_sm=programs, prefix_block_n=block_n,
                             prefix_warps=warps, **suffix)


def sweep_shape(name: str) -> dict:
    """The kernel sweep at one shape (module doc, part 1)."""
    from asyncrl.engine import cascade as cm
    from asyncrl.engine.cascade import prefix_splits_for
    from asyncrl.engine.triton_decode import num_sms

    shape = SHAPES[name]
    sms = num_sms(torch.device(DEVICE))
    cases = {s: Case(shape, s) for s in shape["suffixes"]}
    first = cases[shape["suffixes"][0]]
    res = dict(shape=name, **{k: v for k, v in shape.items() if k != "suffixes"}, sms=sms,
               tiles=first.plan.num_tiles, plan_host_us=round(first.plan_us, 1),
               plain_us={s: c.plain_us for s, c in cases.items()}, prefix_sweep={}, suffix_sweep={}, full={})
    print(name, "plain", json.dumps(res["plain_us"]), flush=True)
    for (block_n, warps) in PREFIX_TILES:  # prefix sweep: once per shape (independent of S)
        for programs in PREFIX_PROGRAMS:
            for chunks in PREFIX_CHUNKS:
                if chunks > 1 and shape["prefix"] // chunks < block_n:
                    continue  # chunks shorter than one tile: the same work as fewer chunks
                rule = prefix_rule(chunks, programs, block_n, warps)
                first.set_chunks(chunks)
                key = f"c{chunks} p{programs} n{block_n} w{warps}"
                row = dict(prefix_us=first.prefix_alone(rule), **first.cascade(rule))
                res["prefix_sweep"][key] = row
                print(name, "prefix", key, json.dumps(row), flush=True)
    for s, case in cases.items():  # suffix sweep at each S, a 1-chunk prefix
        case.set_chunks(1)
        res["suffix_sweep"][s] = {}
        for vname in SUFFIX_VARIANTS:
            fields, launch = suffix_launch(vname)
            row = case.suffix_alone(dataclasses.replace(BEFORE, **fields), launch)
            res["suffix_sweep"][s][vname] = row
            print(name, f"suffix S={s}", vname, json.dumps(row), flush=True)
    ok = lambda rows: {k: v for k, v in rows.items() if v["max_abs_diff"] < TOL}  # noqa: E731
    best_prefix = min(ok(res["prefix_sweep"]), key=lambda k: res["prefix_sweep"][k]["prefix_us"])
    c, p, n, w = (int(x[1:]) for x in best_prefix.split())
    for s, case in cases.items():  # full cascade at each S
        full = res["full"][s] = {}
        case.set_chunks(1)
        full["today"] = case.cascade(BEFORE)
        for fill in FILLS[1:]:
            rule = dataclasses.replace(BEFORE, prefix_fill=fill)
            chunks = prefix_splits_for(case.plan.num_tiles, HKV, shape["prefix"], sms, rule)
            case.set_chunks(chunks)
            full[f"fill {fill}"] = dict(chunks=chunks, **case.cascade(rule))
        best_sfx = min(ok(res["suffix_sweep"][s]), key=lambda k: res["suffix_sweep"][s][k]["us"])
        fields, launch = suffix_launch(best_sfx)
        case.set_chunks(c)
        full["best"] = dict(prefix=best_prefix, suffix=best_sfx,
                            **case.cascade(prefix_rule(c, p, n, w, **fields), launch))
        for key, rule in (("defaults", CascadeLaunchRule()), ("configured", cm.CASCADE_RULE)):
            chunks = prefix_splits_for(case.plan.num_tiles, HKV, shape["prefix"], sms, rule)
            case.set_chunks(chunks)
            full[key] = dict(chunks=chunks, **case.cascade(rule))
        print(name, f"full S={s}", json.dumps(full), flush=True)
    res["best_prefix"] = best_prefix
    return res


def pick(shapes: list[dict]) -> dict:
    """Thresholds from the sweep: the fill with the lowest summed time relative to today's (all
    shapes, all S), the prefix launch (programs, BLOCK_N, warps) with the lowest summed prefix
    time over shapes at its best chunk count, the suffix variant with the lowest summed time
    relative to ``default``; the ``ASYNCRL_CASCADE_LAUNCH`` they make."""
    rel = lambda full, key: full[key]["us"] / full["today"]["us"]  # noqa: E731
    fills = {f"fill {f}": sum(rel(full, f"fill {f}") for r in shapes for full in r["full"].values())
             for f in FILLS[1:]}
    fills["today"] = float(sum(len(r["full"]) for r in shapes))
    best_fill = min(fills, key=fills.get)
    launches: dict[str, float] = {}
    for r in shapes:
        per_launch: dict[str, float] = {}
        for key, row in r["prefix_sweep"].items():
            if row["max_abs_diff"] < TOL:
                lk = key.split(" ", 1)[1]
                per_launch[lk] = min(per_launch.get(lk, 1e9), row["prefix_us"])
        for lk, us in per_launch.items():
            launches[lk] = launches.get(lk, 0.0) + us / min(per_launch.values())
    best_launch = min(launches, key=launches.get)
    sfx: dict[str, float] = {}
    for r in shapes:
        for rows in r["suffix_sweep"].values():
            for k, row in rows.items():
                bad = row["max_abs_diff"] >= TOL
                sfx[k] = sfx.get(k, 0.0) + (1e9 if bad else row["us"] / rows["default"]["us"])
    best_sfx = min(sfx, key=sfx.get)
    p, n, w = (int(x[1:]) for x in best_launch.split())
    env = [] if best_fill == "today" else [f"prefix_fill={best_fill.split()[1]}"]
    env += [f"{k}={v}" for k, v in (("prefix_programs_per_sm", p), ("prefix_block_n", n), ("prefix_warps", w))
            if v != getattr(BEFORE, k)]
    fields, special = SUFFIX_VARIANTS[best_sfx]
    env += [f"{k}={v}" for k, v in fields.items()]
    note = {None: "", "table": "the suffix's best needs ASYNCRL_DECODE_VARIANT=base,1 (plain decode too)",
            "packed": "the suffix's best needs ASYNCRL_DECODE_VARIANT=packed (plain decode too)"}[special]
    return dict(fill_relative_sum=fills, best_fill=best_fill, prefix_launch_relative_sum=launches,
                best_prefix_launch=best_launch, suffix_relative_sum=sfx, best_suffix=best_sfx, note=note,
                env="ASYNCRL_CASCADE_LAUNCH=" + ",".join(env))


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


def offline_report() -> int:
    """No GPU: compile the prefix kernel at each (BLOCK_N, warps) and the cascade suffix kernel at
    each suffix variant for sm90 (``sm90_offline``) and print shared memory and registers."""
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine.triton_decode import DECODE_LAUNCH, _paged_decode_kernel, _prefix_kernel, cascade_suffix_launch

    def build(kernel, consts, warps, stages):
        ptrs = {a: "*i32" for a in ("BT", "CL", "START", "NSP", "TILES", "ORDER")} | {a: "*bf16" for a in "QKVO"}
        ptrs |= {"PO": "*bf16", "PL": "*fp32", "SO": "*fp32", "SL": "*fp32"}
        sig = {a: ptrs.get(a, "fp32" if a == "scale" else ("i32" if a.startswith("stride") or a == "max_parts"
                                                            else "constexpr"))
               for a in kernel.arg_names}
        aligned = [a for a in sig if sig[a].startswith("*") or (a.startswith("stride") and a != "stride_bt")]
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        compiled = compile_sm90(kernel, sig, consts, attrs, warps, stages)
        return f"shared {compiled.metadata.shared // 1024} KiB, {register_usage(compiled)}"

    for block_n, warps in PREFIX_TILES:
        consts = dict(GROUP=H // HKV, MPT=16, BLOCK_M=32, D=D, BLOCK_D=D, PAGE=PAGE, BLOCK_N=block_n, HKV=HKV,
                      IEEE=False)
        print(f"prefix n{block_n} w{warps}: {build(_prefix_kernel, consts, warps, 3)}", flush=True)
    for name, (fields, special) in SUFFIX_VARIANTS.items():
        if special == "packed":
            continue  # bench/paged_decode_variants.py --offline compiles the packed kernel
        rule = dataclasses.replace(BEFORE, **fields)
        launch = cascade_suffix_launch(rule, DECODE_LAUNCH)
        consts = dict(GROUP=H // HKV, BLOCK_G=16, D=D, BLOCK_D=D, PAGE=PAGE, BLOCK_N=launch.block_n, IEEE=False,
                      CASCADE=True, KV_SPLITS=max(1, rule.suffix_kv_splits), QLEN=1,
                      BT_REGS=16 if special == "table" else 0, EARLY_PREFIX=bool(rule.suffix_early_prefix))
        print(f"suffix {name}: {build(_paged_decode_kernel, consts, launch.num_warps, launch.num_stages)}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", default="b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--offline", action="store_true", help="no GPU: sm90 resources of each launch")
    args = ap.parse_args()
    if args.offline:
        return offline_report()
    shapes = args.shape.split(",")
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        ap.error(f"--shape: unknown {unknown}; the shapes are {', '.join(SHAPES)}")
    t0 = time.time()
    out = dict(provenance(" ".join(sys.argv)), env=os.environ.get("ASYNCRL_CASCADE_LAUNCH", ""))
    if not args.skip_kernel:
        out["kernel"] = [sweep_shape(x) for x in shapes]
        out["pick"] = pick(out["kernel"])
        print("pick", json.dumps(out["pick"]), flush=True)
        print(f"kernel sweep: {time.time() - t0:.0f} s", flush=True)
    if not args.skip_engine and "b" in shapes:
        out["engine_b"] = engine_b(args.repeats)
        print("engine_b", json.dumps({k: v for k, v in out["engine_b"].items() if not isinstance(v, list)}), flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
