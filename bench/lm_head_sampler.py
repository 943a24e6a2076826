"""The LM head + sampler of a decode step: ``F.linear`` then ``triton_sampler.sample_unfiltered`` (the engine's
sampling graphs) against ``triton_lm_sampler.lm_head_sample`` (the sampler in the GEMM's epilogue, no logits).

Qwen3's 151,936-token vocabulary, bf16 head weights of width 1,024 (0.6B) or 4,096 (8B), batches 512-8, every row
at T = 1 (the RL default: no divisions) and with mixed temperatures (greedy, 0.7, 1). Per batch: the share of rows
whose tokens agree (a logit one bf16 step from cuBLAS's may flip a near tie) and the max |log-prob difference| on
the agreeing rows, then both timed in CUDA graphs (``triton.testing.do_bench_cudagraph``, median), and with
``--sweep`` the fused kernel's launch over tiles, warps, stages and programs along the vocabulary (what to set in
``triton_lm_sampler.LAUNCH``).

    python bench/lm_head_sampler.py --sweep --json bench/results/lm_head_sampler_h200.json   # ~2 min, H200
    python bench/lm_head_sampler.py --offline   # no GPU: the launches compiled for sm90, registers / shared memory
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402

VOCAB = 151936
WIDTHS = {"0.6b": 1024, "8b": 4096}


def case(B: int, K: int, mixed: bool, g: torch.Generator):
    """hidden ``[B, K]``, head ``[V, K]`` (bf16; logits ~N(0, 3^2)), temperatures ``[B]``, keys ``[B]``."""
    from asyncrl.engine.sampler import row_keys

    hidden = torch.randn(B, K, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, K, device="cuda", generator=g) * 3 / K ** 0.5).to(torch.bfloat16)
    temp = torch.tensor([(0.0, 0.7, 1.0)[i % 3] if mixed else 1.0 for i in range(B)], device="cuda")
    seeds = torch.arange(B, dtype=torch.int64, device="cuda")
    return hidden, weight, temp, row_keys(seeds, torch.zeros_like(seeds), seeds + 11)


def launches() -> list[tuple]:
    """(BM, BN, BK, warps, stages, programs per SM; 0: one per vocab tile) candidates."""
    return [(bm, bn, bk, w, s, p) for bm, bn, bk, (w, s), p in itertools.product(
        (64, 128), (64, 128), (64, 128), ((8, 3), (4, 4), (8, 4)), (0, 1, 2))]


def measure(B: int, K: int, mixed: bool, sweep: bool, g: torch.Generator) -> dict:
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine.triton_lm_sampler import LAUNCH, lm_head_sample
    from asyncrl.engine.triton_sampler import sample_unfiltered

    hidden, weight, temp, keys = case(B, K, mixed, g)
    engine = lambda: sample_unfiltered(F.linear(hidden, weight), temp, keys)  # noqa: E731
    (want_t, want_l), (got_t, got_l) = engine(), lm_head_sample(hidden, weight, temp, keys)
    same = got_t == want_t
    row = dict(batch=B, width=K, temperatures="mixed" if mixed else "all 1", tokens_agree=same.float().mean().item(),
               max_abs_logprob_diff=(got_l - want_l)[same].abs().max().item(),
               engine_us=round(do_bench_cudagraph(engine, rep=50) * 1e3, 2))
    row["fused_us"] = round(do_bench_cudagraph(lambda: lm_head_sample(hidden, weight, temp, keys), rep=50) * 1e3, 2)
    row["fused_x"] = round(row["engine_us"] / row["fused_us"], 3)
    if sweep:
        timed = {}
        for config in launches():
            try:
                timed[config] = do_bench_cudagraph(lambda: lm_head_sample(hidden, weight, temp, keys, config),
                                                   rep=20) * 1e3
            except Exception as exc:  # noqa: BLE001 - out of shared memory: not a candidate
                print(f"  {config}: {repr(exc)[:100]}", flush=True)
        best = min(timed, key=timed.get)
        row.update(engine_launch=LAUNCH, best_launch=best, best_us=round(timed[best], 2))
    print(row, flush=True)
    return row


def offline() -> list[dict]:
    """Each candidate launch's kernel compiled for sm90 (``bench/sm90_offline.py``): registers, shared memory."""
    from sm90_offline import compile_sm90, register_usage

    from asyncrl.engine import triton_lm_sampler as ls

    rows = []
    for bm, bn, bk, warps, stages in sorted({c[:5] for c in launches()}):
        consts = dict(BM=bm, BN=bn, BK=bk, U_HI=ls.U_MAX, PREC="tf32")
        sig = dict(h_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>", TEMP="*fp32",
                   KEYS="*i64", PART="*fp32", IPART="*i32", M="i32", V="i32", K="i32", n_tiles="i32")
        compiled = compile_sm90(ls._lm_head_partial_kernel, sig | {k: "constexpr" for k in consts}, consts, {},
                                warps, stages)
        rows.append(dict(launch=(bm, bn, bk, warps, stages), usage=register_usage(compiled),
                         shared_bytes=compiled.metadata.shared))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="512,256,128,64,8")
    ap.add_argument("--widths", default="0.6b,8b")
    ap.add_argument("--sweep", action="store_true", help="sweep the fused kernel's launch at each batch")
    ap.add_argument("--offline", action="store_true", help="compile for sm90 without a GPU and report resources")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = provenance(" ".join(sys.argv))
    if args.offline:
        out["offline"] = offline()
    else:
        g = torch.Generator(device="cuda").manual_seed(0)
        out["rows"] = []
        for w in args.widths.split(","):
            for B in map(int, args.batches.split(",")):
                for mixed in (False, True):
                    out["rows"].append(measure(B, WIDTHS[w], mixed, args.sweep and not mixed, g))
                    write_json(args.json, out)  # each row as it comes: a call cut at its time limit keeps them
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
