"""MoE routing glue per layer, torch vs Triton, at the Qwen3-30B-A3B shape (one GPU, < 1 min).

    python bench/moe_glue.py --json bench/results/moe_glue_h200.json

What runs between a MoE layer's router GEMM and its grouped GEMM, for T = 32, 256, 16384 tokens
(hidden 2048, 128 experts, top-8, renormalised, bf16):
  * old: ``moe.route_torch`` (softmax, topk, renormalise, cast), routing replay's record (cast to
    int16, index_put at the tokens' KV slots) and ``triton_moe.align_pairs`` (index_add_ counts,
    argsort, cumsum, searchsorted, scatter): ~17 launches;
  * new: ``triton_moe_align.fused_route`` (record included) + ``moe_align_block_size``: 3 launches.
Microseconds per layer by CUDA events over 200 iterations after 20 of warm-up, both eager (what
prefill pays: launches included) and replayed from a CUDA graph (what graphed decode pays).

Check (same run): the new routing's experts equal the old's (per token as a set; order may differ
only among exactly tied probabilities), its bf16 weights equal the old's per expert (exact
fraction and max difference reported), and the new align of the OLD ids equals the old align
element for element.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.models.moe import route_torch  # noqa: E402
from asyncrl.engine.triton_moe import align_pairs  # noqa: E402
from asyncrl.engine.triton_moe_align import fused_route, moe_align_block_size  # noqa: E402
from asyncrl.engine.triton_moe_tiles import pick_tiles  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def old_route(logits, record):
    """The engine's routing before triton_moe_align: torch router + an index_put of the record."""
    weights, ids = route_torch(logits, TOP_K, True)
    buffer, slots, column = record
    buffer[slots, column] = ids.to(buffer.dtype)
    return weights, ids


def glue(route, align, logits, block_m, record):
    """One layer's glue: route the logits (recording the ids), align the chosen pairs."""
    weights, ids = route(logits, record)
    return weights, ids, align(ids, EXPERTS, block_m)


def time_us(fn, iters: int, warmup: int, graph: bool) -> float:
    """Mean microseconds of ``fn()`` by CUDA events; ``graph``: captured once, replayed."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / iters, 2)


def check(logits, block_m) -> dict:
    """New vs old outputs on the same logits (and the same ids for the align)."""
    rec_old = _record(logits.shape[0], logits.device)
    rec_new = (rec_old[0].clone(), rec_old[1], rec_old[2])  # same slots
    w_old, ids_old = old_route(logits, rec_old)
    w_new, ids_new = fused_route(logits, TOP_K, True, rec_new)
    same_set = (ids_old.sort(-1).values == ids_new.sort(-1).values).all(-1)
    # weights per expert: reorder both by expert id
    w_old_e = w_old.gather(1, ids_old.argsort(-1)).float()
    w_new_e = w_new.gather(1, ids_new.argsort(-1)).float()
    pairs_old, blocks_old = align_pairs(ids_old, EXPERTS, block_m)
    pairs_new, blocks_new = moe_align_block_size(ids_old, EXPERTS, block_m)
    records_equal = torch.equal(rec_old[0].sort(-1).values, rec_new[0].sort(-1).values)
    return dict(expert_sets_equal=bool(same_set.all()), rows_with_other_set=int((~same_set).sum()),
                records_equal=records_equal,
                same_order_rows=round((ids_old == ids_new).all(-1).float().mean().item(), 5),
                weights_exact_fraction=round((w_old_e == w_new_e).float().mean().item(), 6),
                weights_max_abs_diff=float((w_old_e - w_new_e).abs().max()),
                align_equal=bool(torch.equal(pairs_old.int(), pairs_new) and torch.equal(blocks_old.int(), blocks_new)))


def _record(T: int, device="cuda"):
    """Routing replay's buffer ``[slots, 48 layers, K]`` int16, layer 7's column, T shuffled slots."""
    buffer = torch.zeros(T + 64, 48, TOP_K, dtype=torch.int16, device=device)
    return buffer, torch.randperm(T + 64, device=device)[:T], 7


def bench_tokens(T: int, iters: int, warmup: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    router = torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) * HIDDEN ** -0.5
    logits = F.linear(x, router)  # the router GEMM is the same on both paths: not timed
    block_m = pick_tiles(T * TOP_K, EXPERTS, INTER, HIDDEN).block_m  # the tile height the engine aligns to
    row = dict(tokens=T, pairs=T * TOP_K, block_m=block_m)
    record = _record(T)
    new_route = lambda lg, rec: fused_route(lg, TOP_K, True, rec)  # noqa: E731
    paths = {"old": (old_route, align_pairs), "new": (new_route, moe_align_block_size)}
    for name, (route, align) in paths.items():
        for graph in (False, True):
            key = f"{name}_{'graph' if graph else 'eager'}_us"
            row[key] = time_us(lambda: glue(route, align, logits, block_m, record), iters, warmup, graph)
        row[f"{name}_route_graph_us"] = time_us(lambda: route(logits, record), iters, warmup, True)
    row["speedup_graph"] = round(row["old_graph_us"] / row["new_graph_us"], 2)
    row["speedup_eager"] = round(row["old_eager_us"] / row["new_eager_us"], 2)
    row["check"] = check(logits, block_m)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="32,256,16384")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_glue.py needs a CUDA GPU")
    out = dict(provenance(" ".join(sys.argv)), shape=f"hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}", rows=[])
    for T in (int(t) for t in args.tokens.split(",")):
        out["rows"].append(bench_tokens(T, args.iters, args.warmup))
        r = out["rows"][-1]
        print(f"T={T:>6}: old {r['old_graph_us']:>8} us graph / {r['old_eager_us']:>8} eager; "
              f"new {r['new_graph_us']:>7} us graph / {r['new_eager_us']:>7} eager; "
              f"x{r['speedup_graph']} graph, x{r['speedup_eager']} eager; check {json.dumps(r['check'])}",
              flush=True)
    write_json(args.json, out)
    ok = all(r["check"]["expert_sets_equal"] and r["check"]["align_equal"] and r["check"]["records_equal"]
             for r in out["rows"])
    print("outputs equal (expert sets, align):", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
