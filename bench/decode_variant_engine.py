"""The engine with the base vs a packed paged-decode launch, bf16 and FP8 K/V, in ONE run (GPU).

Rows of ``bench/fp8_rollout.py`` (same model, workloads, warm-up and log-prob mismatch against HF)
with the decode launch switched per row: ``triton_decode.DECODE_LAUNCH`` is what every decode /
cascade call uses when none is passed, and each row's engine captures its CUDA graphs at start-up,
so setting it before the row's engine is built is the same as starting the process with
``ASYNCRL_DECODE_LAUNCH`` / ``ASYNCRL_DECODE_VARIANT``. Rows: ``bf16`` / ``kv_fp8`` (the engine's
launch) and ``bf16_packed`` / ``kv_fp8_packed`` (``--launch`` / ``--variant``, the forms the two
environment variables take; default ``PACKED_LAUNCH``). Each row reports its launch and how often the
packed kernel was launched from Python (0 on the base rows; > 0 on the packed rows on a GPU: the
switch took). The last line gives each row over ``bf16``.

    python bench/decode_variant_engine.py --json bench/results/decode_variant_engine_h200.json   # ~2 min
    python bench/decode_variant_engine.py --variant packed,0,2,16,1 --workloads a   # another launch, (a) only
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_rollout  # noqa: E402 - bench/ is this script's directory

from asyncrl.engine import triton_decode, triton_decode_packed  # noqa: E402

ROWS = {"bf16": ({}, False), "bf16_packed": ({}, True),
        "kv_fp8": ({"kv_cache_dtype": "fp8"}, False), "kv_fp8_packed": ({"kv_cache_dtype": "fp8"}, True)}


def packed_launch(launch: str, variant: str) -> triton_decode.DecodeLaunch:
    """The launch the engine would take from ``ASYNCRL_DECODE_LAUNCH=launch ASYNCRL_DECODE_VARIANT=variant``."""
    with mock.patch.dict(os.environ, {"ASYNCRL_DECODE_LAUNCH": launch, "ASYNCRL_DECODE_VARIANT": variant}):
        return triton_decode._launch_from_env()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--launch", default="",
                    help="ASYNCRL_DECODE_LAUNCH form for the packed rows ('' = PACKED_LAUNCH's)")
    ap.add_argument("--variant", default="packed", help="ASYNCRL_DECODE_VARIANT form for the packed rows")
    ours, rest = ap.parse_known_args(argv)
    packed = packed_launch(ours.launch, ours.variant)
    print(f"packed rows: {packed}", flush=True)
    launches = {id(opts): (packed if is_packed else triton_decode.DecodeLaunch()) for opts, is_packed in ROWS.values()}
    run_row = fp8_rollout.run_row

    calls = []  # packed-kernel launches from Python (eager steps and graph captures): proves the switch took
    launch_packed = triton_decode_packed.launch_packed

    def counted(*a, **k):
        calls.append(1)
        return launch_packed(*a, **k)

    def run_row_with_launch(hf, options, engine, a, c, args):
        triton_decode.DECODE_LAUNCH = launches[id(options)]  # read at every call; graphs capture it at start-up
        calls.clear()
        try:
            row = run_row(hf, options, engine, a, c, args)
        finally:
            triton_decode.DECODE_LAUNCH = triton_decode.DecodeLaunch()
        return row | {"decode_launch": str(launches[id(options)]), "packed_kernel_calls": len(calls)}

    with mock.patch.object(fp8_rollout, "ROWS", {name: opts for name, (opts, _) in ROWS.items()}), \
            mock.patch.object(fp8_rollout, "run_row", run_row_with_launch), \
            mock.patch.object(triton_decode_packed, "launch_packed", counted):
        return fp8_rollout.main(["--no-gemm", "--rows", ",".join(ROWS), *rest])


if __name__ == "__main__":
    raise SystemExit(main())
