"""How the engine's decode kernel keeps K/V tiles in flight, by block-table width (issue 23, GPU).

With a table lookup in the tile loop, each K/V address waits on a load of its own iteration and Triton 3.6
keeps one tile in flight. Two launches take the lookup off that chain: the block-table row in registers
(``DecodeLaunch.table_in_registers``: one load, then a reduction over the row's width for every tile) and
the next tile's block id prefetched a tile ahead (``table_prefetch``, ``bt_prefetch``). The engine's
tables are ``max_model_len / block_size`` wide (33-64 columns in the benches), far wider than a context
needs, so each launch is timed at the shape's own width and at 64 columns (scratch-padded, as the
engine pads). One layer of the 0.6B shape (``paged_decode_sweep.case``), workload (a)'s and (c)'s shapes,
bf16 and e4m3 K/V, CUDA-graph timed (us); ``table_x`` / ``prefetch_x`` = plain / launch (> 1: faster).

    python bench/decode_table_width.py bench/results/decode_prefetch_width_h200.json   # ~30 s, one H200
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = ((256, 260), (256, 384), (256, 512), (8, 1500), (8, 2300), (64, 1500), (64, 2300))
ENGINE_WIDTH = 64  # bench_rollout's max_model_len 4,096 / 64-token blocks


def widened(bt: torch.Tensor, width: int, scratch: int) -> torch.Tensor:
    """``bt`` [B, M] padded to ``width`` columns with the scratch block (the engine's padding)."""
    wide = torch.full((bt.shape[0], width), scratch, dtype=torch.int32, device=bt.device)
    wide[:, :bt.shape[1]] = bt
    return wide


def main() -> int:
    from paged_decode_sweep import case
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine.triton_decode import DecodeLaunch, paged_decode_attention

    D = 128  # Qwen3-0.6B's head dim
    launches = {"plain": DecodeLaunch(), "table": DecodeLaunch(table_in_registers=True),
                "prefetch": DecodeLaunch(table_prefetch=True)}
    rows = []
    for batch, ctx in SHAPES:
        q, kc, vc, bt, lens = case(batch, ctx)
        for width in (bt.shape[1], ENGINE_WIDTH):
            table = widened(bt, width, kc.shape[0] - 1)
            for dt in (torch.bfloat16, torch.float8_e4m3fn):
                k, v = kc.to(dt), vc.to(dt)
                us, outs = {}, {}
                for name, launch in launches.items():
                    fn = lambda: paged_decode_attention(q, k, v, table, lens, D ** -0.5, launch=launch)  # noqa: E731
                    outs[name] = fn().float()
                    us[name] = round(do_bench_cudagraph(fn, rep=20) * 1e3, 2)
                row = dict(batch=batch, ctx=ctx, width=width, kv=str(dt)[6:], **us,
                           table_x=round(us["plain"] / us["table"], 3), prefetch_x=round(us["plain"] / us["prefetch"], 3),
                           max_abs_diff=max((outs[n] - outs["plain"]).abs().max().item() for n in launches))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
