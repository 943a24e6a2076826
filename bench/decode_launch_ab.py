"""Decode launch rules end to end: workloads (a) and (c), the engine's rule vs alternatives.

``triton_decode.default_launch`` picks the paged-decode launch per batch size (so per CUDA-graph
bucket). Kernel sweeps (bench/paged_decode_variants.py) time uniform contexts and one kernel alone;
a rollout has other kernels between the layers and, in (c), contexts of 100-2,048 tokens in one
batch, where a grid waits on its longest sequence's program. So this times the engine: one engine
per rule and cache dtype (fixed KV pools, so all fit at once), the rule patched in while the engine
captures its graphs and runs, interleaved repeats of ``asyncrl bench rollout``'s workloads (a) and
(c) after one untimed run of each. The first rule named is the baseline. GPU only.

    python bench/decode_launch_ab.py --rules default,small_tiles --json out.json   # ~3 min on an H200
    python bench/decode_launch_ab.py --rules default,default_lpt,small_tiles_fp8_full_lpt --blocks 4500
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import triton_decode as td  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.triton_decode import DecodeLaunch  # noqa: E402

ENGINE_RULE = td.default_launch
SMALL = DecodeLaunch(16, 1, 3, table_prefetch=True)  # 16-token tiles, one warp: ~12 programs per SM
MID = DecodeLaunch(32, 2, 3, table_prefetch=True)
WIDE_FP8 = DecodeLaunch(64, 2, 3, table_prefetch=True)  # small e4m3 grids in the kernel sweep


def _rule(bf16_full: DecodeLaunch, bf16_small: DecodeLaunch | None, fp8_full: DecodeLaunch, fp8_small: DecodeLaunch,
          min_per_sm: int = 6):
    """A rule of the engine's form: a launch per (cache dtype, grid of >= ``min_per_sm`` (sequence, kv
    head) programs per SM or not); None = ``DECODE_LAUNCH``. Verify steps and pinned launches as the engine."""
    def rule(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        if qlen != 1 or not td._launch_is_default():
            return td.DECODE_LAUNCH
        full = batch * hkv >= min_per_sm * td.num_sms(k_cache.device)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        launch = (fp8_full if full else fp8_small) if fp8 else (bf16_full if full else bf16_small)
        return launch or td.DECODE_LAUNCH
    return rule


ALL_RULES = {
    "default": ENGINE_RULE,
    # the kernel sweep's picks: 16-token tiles everywhere but small e4m3 grids
    "small_tiles": _rule(SMALL, SMALL, SMALL, WIDE_FP8),
    "mid": _rule(MID, MID, MID, WIDE_FP8),
}


def small_tiles_fp8(min_per_sm: int):
    """The engine's rule with 16-token tiles (unordered) on e4m3 grids of >= ``min_per_sm`` programs per SM only."""
    def rule(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        full = batch * hkv >= min_per_sm * td.num_sms(k_cache.device)
        if qlen == 1 and td._launch_is_default() and k_cache.dtype == torch.float8_e4m3fn and full:
            return SMALL
        return ENGINE_RULE(batch, hkv, k_cache, qlen)
    return rule


def unordered(rule):
    """``rule`` without ``longest_first``: the engine's rule before 2026-12-04 (session 46)."""
    def plain(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        return dataclasses.replace(rule(batch, hkv, k_cache, qlen), longest_first=False)
    return plain


def longest_first(rule):
    """``rule`` with its plain decodes' programs dispatched longest sequence first (``DecodeLaunch.longest_first``):
    a grid of mixed contexts then ends with short programs instead of waiting on a long one started last."""
    def ordered(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        launch = rule(batch, hkv, k_cache, qlen)
        return dataclasses.replace(launch, longest_first=True) if qlen == 1 else launch
    return ordered


# The engine's rule orders plain decodes longest first since session 46: "default_lpt" = "default" now, and
# "unordered" is the rule the session-45 rows were measured against.
ALL_RULES["unordered"] = unordered(ENGINE_RULE)
ALL_RULES["small_tiles_fp8_full"] = small_tiles_fp8(6)
ALL_RULES["default_lpt"] = longest_first(ENGINE_RULE)
ALL_RULES["small_tiles_lpt"] = longest_first(ALL_RULES["small_tiles"])
ALL_RULES["small_tiles_fp8_full_lpt"] = longest_first(small_tiles_fp8(6))
ALL_RULES["small_tiles_fp8_dense_lpt"] = longest_first(small_tiles_fp8(12))  # >= ~200 sequences at 8 kv heads


def bf16_prefetch_from(min_per_sm: float):
    """The engine's rule with the block-id prefetch on bf16 grids of >= ``min_per_sm`` programs per SM (the
    engine: ``TABLE_MIN_PROGRAMS_PER_SM``). Kernel bench, ordered, bf16 (session 47): prefetch 1.07x at 64 mixed
    sequences (3.9 per SM), equal at 128, 0.94x at 32."""
    def rule(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        launch = ENGINE_RULE(batch, hkv, k_cache, qlen)
        if qlen == 1 and td._launch_is_default() and batch * hkv >= min_per_sm * td.num_sms(k_cache.device):
            return dataclasses.replace(launch, table_prefetch=True)
        return launch
    return rule


ALL_RULES["bf16_prefetch_from3"] = bf16_prefetch_from(3)


def fp8_dense_registers(cap: int, splits: int = 0):
    """The engine's rule with its e4m3 dense launch (16-token tiles, one warp) capped at ``cap`` registers a thread
    (0: uncapped) and each sequence in ``splits`` chunks (0: the engine's): 167 registers uncapped on sm90 = 12
    one-warp programs per SM (workload (a)'s 2,048 programs in 1.3 waves); 128 = 16 and 120 = 17 (one wave), no
    spills at either (``bench/paged_decode_variants.py --offline``; session 49's launch, before the tiled loads)."""
    def rule(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        launch = ENGINE_RULE(batch, hkv, k_cache, qlen)
        if launch != td._FP8_DENSE_LAUNCH:
            return launch
        return dataclasses.replace(launch, max_registers=cap, kv_splits=splits)
    return rule


ALL_RULES["fp8_dense_r128"] = fp8_dense_registers(128)
ALL_RULES["fp8_dense_r120"] = fp8_dense_registers(120)
# session 50's tiled dense launch takes 210 registers (9 programs an SM); 168 = 12, no spills on sm90
ALL_RULES["fp8_dense_r168"] = fp8_dense_registers(168)
ALL_RULES["fp8_dense_split2"] = fp8_dense_registers(0, 2)
ALL_RULES["fp8_dense_r128_split2"] = fp8_dense_registers(128, 2)
# Fewer instructions a tile (``tiled_loads``: block base + fixed offsets, masks on the last tile only;
# ``lazy_rescale``: the accumulator rescaled only when the max moves by more than e^8). Kernel bench (session 50):
# 32-token tiles on one warp with both are the fastest or within 1.5% of it for bf16 and e4m3 at (a), (c) and
# mixed contexts, so one launch for every single-query decode; or the engine's rule with both on its e4m3 dense launch.
TILE32_TILED = DecodeLaunch(32, 1, 3, table_prefetch=True, longest_first=True, tiled_loads=True, lazy_rescale=True)


def one_launch(launch: DecodeLaunch):
    """``launch`` for every single-query decode of an unpinned engine (verify steps, pinned launches: the engine's)."""
    def rule(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
        if qlen != 1 or not td._launch_is_default():
            return ENGINE_RULE(batch, hkv, k_cache, qlen)
        return launch
    return rule


def session49(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
    """The engine's rule until session 50: 64-token tiles on 4 warps (the block-id prefetch from 8 programs per SM
    and on every e4m3 cache), 16-token one-warp tiles on e4m3 grids of >= 12 per SM; no tiled loads, no lazy
    rescale; longest sequence first."""
    if qlen != 1 or not td._launch_is_default():
        return ENGINE_RULE(batch, hkv, k_cache, qlen)
    per_sm = batch * hkv / td.num_sms(k_cache.device)
    if k_cache.dtype == torch.float8_e4m3fn:
        if per_sm >= 12:
            return DecodeLaunch(16, 1, 3, table_prefetch=True, longest_first=True)
        return DecodeLaunch(table_prefetch=True, longest_first=True)
    return DecodeLaunch(table_prefetch=per_sm >= 8, longest_first=True)


def fp8_dense_tiled(batch: int, hkv: int, k_cache: torch.Tensor, qlen: int = 1) -> DecodeLaunch:
    """Session 49's rule with tiled loads and the lazy rescale on its e4m3 16-token launch only."""
    launch = session49(batch, hkv, k_cache, qlen)
    if launch.block_n != 16:
        return launch
    return dataclasses.replace(launch, tiled_loads=True, lazy_rescale=True)


ALL_RULES["session49"] = session49
ALL_RULES["tile32_tiled"] = one_launch(TILE32_TILED)  # measured as "tile32_tiled" in session 50
ALL_RULES["fp8_dense_tiled"] = fp8_dense_tiled  # measured against session 49's rule as "default" in session 50
RULES = dict(ALL_RULES)


def run(repeats: int, kv_dtypes: list[str], blocks: int) -> dict:
    from asyncrl.engine.bench import workloads_ab

    # default_launch is read when the engine captures its graphs and at every eager decode
    variants = {name: functools.partial(setattr, td, "default_launch", rule) for name, rule in RULES.items()}
    try:
        return workloads_ab(variants, kv_dtypes, blocks, repeats)
    finally:
        td.default_launch = ENGINE_RULE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--rules", default="default,small_tiles", help=f"of {sorted(ALL_RULES)}; the first is the baseline")
    ap.add_argument("--blocks", type=int, default=6000,
                    help="KV blocks per engine; every rule's engine is held at once (3 rules: 4500)")
    args = ap.parse_args()
    out = provenance("python bench/decode_launch_ab.py " + " ".join(sys.argv[1:]))
    RULES.clear()
    RULES.update({name: ALL_RULES[name] for name in args.rules.split(",")})
    out["engine"] = run(args.repeats, args.kv.split(","), args.blocks)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
