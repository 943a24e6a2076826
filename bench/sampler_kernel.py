"""Sampler on the GPU: the compiled torch ``sample`` vs the one-pass Triton kernel.

Batches 1, 16, 64, 256, 512 x vocab 151,936 (Qwen), bf16 logits, no top-k/top-p. For each
batch: (1) checks the kernel against the uncompiled torch ``sample`` on every row (mixed
temperatures incl. greedy; tokens identical, log-probs within 1e-4) and the kernel's noise
against ``gumbel_noise`` bit for bit; (2) times, with triton's ``do_bench`` (median, L2
flushed between calls), the compiled torch sampler (``Sampler(compile=True)``, as the
engine warms it up) and the kernel at T = 1 (the RL default), T = 0.7 (the division
path) and on peaked (LM-like) logits at T = 1 (no tile skips its noise since 2026-12-04),
each also replayed from a CUDA graph (device time without launch overhead).
Part 3 times a few launch shapes (tile, warps, programs per SM) at batches 1 and 256.
Part 4 (``--waves``, issue 20) times the wave-aware launch (``waves=True``: splits from the programs that
fit per SM, ``triton_sampler.wave_launch_shape``) against the default one, tiles 2048 and 1024 at 8 warps,
at the engine's fp32 logits, batches 1-512 (the GRPO decode runs batch 128: 94 us per step there).
Exits 1 if any checked row disagrees (a near tie is labelled as such but still fails).

    python bench/sampler_kernel.py --json out.json [--no-sweep] [--no-torch]
    python bench/sampler_kernel.py --waves-only --json out.json    # part 4 alone: ~30 s
    python bench/sampler_kernel.py --offline   # no GPU: registers per launch shape on sm90 -> programs per SM
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

BATCHES = (1, 16, 64, 256, 512)
VOCAB = 151936
SWEEP = ((2048, 8, 4), (1024, 4, 4), (4096, 8, 4), (2048, 8, 8), (4096, 16, 2))  # (tile, warps, programs/SM)


def case(B: int, V: int, seed: int = 0, peaked: bool = False):
    """bf16 logits ``[B, V]``, temperatures ``[B]`` (greedy, 0.7, 1), keys ``[B]``. Random
    normal logits (x3), or ``peaked``: 4 candidates per row 15-20 above a N(0, 2) bulk, a
    synthetic stand-in for an LM's low-entropy steps (until 2026-12-04 the kernel skipped the
    noise of tiles that could not win there)."""
    from asyncrl.engine.sampler import row_keys

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, V, device="cuda", generator=g) * (2 if peaked else 3)
    if peaked:
        cand = torch.randint(0, V, (B, 4), device="cuda", generator=g)
        x.scatter_(1, cand, 15 + 5 * torch.rand(B, 4, device="cuda", generator=g))
    x = x.to(torch.bfloat16)
    temp = torch.tensor([(0.0, 0.7, 1.0)[i % 3] for i in range(B)], device="cuda")
    seeds = torch.arange(B, dtype=torch.int64, device="cuda") + 7919 * seed
    keys = row_keys(seeds, torch.zeros_like(seeds), seeds + 11)
    return x, temp, keys


def check(B: int, peaked: bool = False) -> dict:
    """Kernel vs uncompiled ``sample`` on every row of a mixed-temperature batch."""
    from asyncrl.engine import triton_sampler as ts
    from asyncrl.engine.sampler import gumbel_noise, sample

    x, temp, keys = case(B, VOCAB, seed=B, peaked=peaked)
    tok, lp = ts.sample_unfiltered(x, temp, keys)
    ref_tok, ref_lp = sample(x, temp, torch.zeros_like(keys), torch.ones_like(temp), keys, False)
    diff = (tok != ref_tok).nonzero().flatten()
    near_ties = 0
    if len(diff):
        ra = ts.race_values(x[diff], temp[diff], keys[diff], tok[diff])
        rb = ts.race_values(x[diff], temp[diff], keys[diff], ref_tok[diff])
        near_ties = int(((ra - rb).abs() <= 1e-5 * rb.abs().clamp(min=1)).sum())
    same = tok == ref_tok
    lp_err = (lp[same] - ref_lp[same]).abs().max().item()
    noise_equal = torch.equal(ts.noise(keys[:8], VOCAB), gumbel_noise(keys[:8], VOCAB))
    return {"batch": B, "peaked": peaked, "rows": B, "token_mismatches": len(diff), "near_ties": near_ties,
            "max_logprob_err": lp_err, "noise_bit_identical": noise_equal,
            "ok": len(diff) == 0 and lp_err < 1e-4 and noise_equal}


def median_ms(fn, graph: bool = False) -> float:
    """triton.testing's do_bench (L2 flushed between calls) or do_bench_cudagraph, median."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def timed(fn, graph: bool = True) -> dict:
    """Median ms: eager launches and CUDA-graph replay (None if capture fails)."""
    out = {"ms": median_ms(fn)}
    if not graph:  # the engine runs the torch sampler eagerly; a failed capture could linger
        return out
    try:
        out["graph_ms"] = median_ms(fn, graph=True)
    except Exception as e:  # noqa: BLE001 -- report, keep timing the rest
        out["graph_ms"], out["graph_error"] = None, repr(e)[:200]
    return out


def bench_batch(B: int, torch_sampler) -> dict:
    from asyncrl.engine import triton_sampler as ts

    x, _, keys = case(B, VOCAB, seed=B + 1)
    row = {"batch": B}
    for T in (1.0, 0.7):
        temp = torch.full((B,), T, device="cuda")
        row[f"triton_T{T}"] = timed(lambda: ts.sample_unfiltered(x, temp, keys))
    xp, _, _ = case(B, VOCAB, seed=B + 1, peaked=True)
    temp = torch.ones(B, device="cuda")
    row["triton_peaked_T1.0"] = timed(lambda: ts.sample_unfiltered(xp, temp, keys))
    if torch_sampler is not None:
        floats = torch.stack([torch.ones(B, device="cuda"), torch.ones(B, device="cuda")])
        ints = torch.stack([keys, torch.zeros_like(keys)])
        row["torch_compiled_T1.0"] = timed(lambda: torch_sampler(x, floats, ints, False), graph=False)
    row["read_logits_ms"] = B * VOCAB * 2 / 4.8e12 * 1e3  # one pass at the H200's 4.8 TB/s
    return row


def sweep(batches=(1, 256)) -> list[dict]:
    from asyncrl.engine import triton_sampler as ts

    rows = []
    for B in batches:
        x, _, keys = case(B, VOCAB, seed=B + 2)
        temp = torch.ones(B, device="cuda")
        ref = ts.sample_unfiltered(x, temp, keys)[0]
        for tile, warps, pps in SWEEP:
            fn = functools.partial(ts.sample_unfiltered, x, temp, keys, block=tile, num_warps=warps,
                                   programs_per_sm=pps)
            same = torch.equal(fn()[0], ref)  # the launch shape must not change a token
            rows.append({"batch": B, "tile": tile, "warps": warps, "programs_per_sm": pps, "same_tokens": same,
                         "splits": ts.launch_shape(B, VOCAB, x.device, tile, pps)[0],
                         "ms": median_ms(fn)})
    return rows


def wave_sweep(batches=(1, 16, 64, 128, 256, 512)) -> list[dict]:
    """Default vs wave-aware splits, fp32 logits (the engine's), T = 1 random and peaked rows; CUDA-graph
    replay times (the engine replays the sampler in its decode graph)."""
    from asyncrl.engine import triton_sampler as ts

    rows = []
    for B in batches:
        for peaked in (False, True):
            x, _, keys = case(B, VOCAB, seed=B + 5, peaked=peaked)
            x, temp = x.float(), torch.ones(B, device="cuda")
            ref = ts.sample_unfiltered(x, temp, keys)[0]
            for tile, warps in ((2048, 8), (1024, 8)):
                for waves in (False, True):
                    fn = functools.partial(ts.sample_unfiltered, x, temp, keys, block=tile, num_warps=warps,
                                           waves=waves)
                    splits = (ts.wave_launch_shape(B, VOCAB, x.device, tile, ts.RESIDENT_PER_SM[tile, warps])
                              if waves else ts.launch_shape(B, VOCAB, x.device, tile))[0]
                    same = torch.equal(fn()[0], ref)  # the launch shape must not change a token
                    rows.append({"batch": B, "peaked": peaked, "tile": tile, "warps": warps, "waves": waves,
                                 "splits": splits, "same_tokens": same, "ms": median_ms(fn, graph=True)})
    return rows


def offline() -> int:
    """``_partial_kernel`` compiled for sm90 per (tile, warps): registers, and the programs that fit on an
    SM (65,536 registers; at most 64 warps): ``triton_sampler.RESIDENT_PER_SM``'s numbers."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine import triton_sampler as ts

    sig = dict(X="*fp32", stride_x="i32", V="i32", TEMP="*fp32", KEYS="*i64", PART="*fp32", IPART="*i32",
               n_splits="i32", n_tiles="i32", BLOCK="constexpr", U_HI="constexpr")
    for (tile, warps), table in ts.RESIDENT_PER_SM.items():
        consts = dict(BLOCK=tile, U_HI=ts.U_MAX)
        usage = register_usage(compile_sm90(ts._partial_kernel, sig, consts, {(0,): [["tt.divisibility", 16]]},
                                            warps, 3))
        regs = int(usage.split("REG:")[1].split()[0])
        fit = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 64 // warps)
        print(f"tile {tile:4d} x {warps} warps: {usage}; {fit} programs per SM (RESIDENT_PER_SM: {table})")
    return 0


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    ap.add_argument("--no-torch", action="store_true", help="skip the compiled torch sampler (its compile)")
    ap.add_argument("--waves", action="store_true", help="also part 4: the wave-aware launch vs the default")
    ap.add_argument("--waves-only", action="store_true", help="part 4 alone")
    ap.add_argument("--offline", action="store_true", help="no GPU: sm90 registers -> programs per SM")
    args = ap.parse_args()
    if args.offline:
        return offline()
    assert torch.cuda.is_available(), "needs CUDA"
    t_start = time.perf_counter()
    if args.waves_only:
        return _print_waves(wave_sweep(), args.json)
    from asyncrl.engine.sampler import Sampler

    checks = [check(B) for B in BATCHES] + [check(B, peaked=True) for B in (16, 256)]
    torch_sampler = None
    t_compile = None
    if not args.no_torch:
        t0 = time.perf_counter()
        torch_sampler = Sampler(torch.device("cuda"), compile=True)  # the torch path (no triton)
        for B in (1, 3):  # as ModelRunner._warmup_sampler: batch 1 and the dynamic shape
            x, _, keys = case(B, VOCAB)
            torch_sampler(x, torch.ones(2, B, device="cuda"), torch.stack([keys, torch.zeros_like(keys)]), False)
        torch.cuda.synchronize()
        t_compile = time.perf_counter() - t0
    rows = [bench_batch(B, torch_sampler) for B in BATCHES]
    sweep_rows = [] if args.no_sweep else sweep()
    if args.waves:
        _print_waves(wave_sweep(), None)

    print("ms, median; (graph): CUDA-graph replay; speedup: torch / triton T1, eager calls")
    print(f"{'batch':>5} {'torch':>7} {'triton T1':>9} {'(graph)':>8} {'T0.7':>7} {'(graph)':>8} "
          f"{'peaked':>7} {'(graph)':>8} {'speedup':>7} {'1 read':>7}")
    f = lambda v: f"{v:.4f}" if isinstance(v, float) else "  -   "  # noqa: E731
    for r in rows:
        tt = r.get("torch_compiled_T1.0", {})
        a, b, c = r["triton_T1.0"], r["triton_T0.7"], r["triton_peaked_T1.0"]
        sp = tt["ms"] / a["ms"] if tt else float("nan")
        print(f"{r['batch']:>5} {f(tt.get('ms')):>7} {f(a['ms']):>9} {f(a['graph_ms']):>8} {f(b['ms']):>7} "
              f"{f(b['graph_ms']):>8} {f(c['ms']):>7} {f(c['graph_ms']):>8} {sp:>7.1f} {r['read_logits_ms']:>7.4f}")
    for s in sweep_rows:
        print(f"sweep B={s['batch']:>3} tile={s['tile']:>4} warps={s['warps']:>2} programs/SM={s['programs_per_sm']} "
              f"splits={s['splits']:>2}: {s['ms']:.4f} ms same_tokens={s['same_tokens']}")
    for c in checks:
        print(f"check B={c['batch']:>3}{' peaked' if c['peaked'] else ''}: "
              f"mismatches={c['token_mismatches']} (near ties {c['near_ties']}) max |dlogp|={c['max_logprob_err']:.2e} noise bit-identical={c['noise_bit_identical']} ok={c['ok']}")
    ok = all(c["ok"] for c in checks) and all(s["same_tokens"] for s in sweep_rows)
    elapsed = time.perf_counter() - t_start
    print(f"torch compile+warmup {t_compile if t_compile is None else round(t_compile, 1)} s; total {elapsed:.1f} s; "
          f"{'OK' if ok else 'DISAGREEMENT'}")
    write_json(args.json, {**provenance(" ".join(sys.argv)), "triton": __import__("triton").__version__, "vocab": VOCAB,
                           "dtype": "bfloat16", "rows": rows, "sweep": sweep_rows, "checks": checks,
                           "torch_compile_s": t_compile, "elapsed_s": elapsed, "ok": ok})
    return 0 if ok else 1


def _print_waves(rows: list[dict], path) -> int:
    for r in rows:
        print(f"waves B={r['batch']:>3}{' peaked' if r['peaked'] else '       '} tile={r['tile']:>4} "
              f"warps={r['warps']} {'waves  ' if r['waves'] else 'default'} splits={r['splits']:>3}: "
              f"{r['ms']:.4f} ms same_tokens={r['same_tokens']}")
    write_json(path, {**provenance(" ".join(sys.argv)), "triton": __import__("triton").__version__, "vocab": VOCAB,
                      "dtype": "float32", "waves": rows})
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
