"""The cascade decode's prefix and suffix kernels serialized vs concurrent (issue 20/23,
``CascadeLaunchRule.concurrent_prefix``): the prefix kernel on a side stream beside a suffix kernel
that does not read its partials, then a merge kernel.

(a) Kernel level, the GRPO rollout's attention (16 groups x 8 samples, prefix 256, batch 128,
    Qwen3-0.6B's 16 q / 8 kv heads x 128, block 64, bf16) at suffixes of 1, 64 and 256 tokens:
    one CUDA graph of ``LAYERS`` calls in a row (each on its own K/V cache, as the model's layers:
    the next call's K/V is not in L2), replayed ``--replays`` times between CUDA events -> us per
    call; both modes with the defaults (``CascadeLaunchRule()``, prefix chunks per the rule), and
    each mode's pieces alone (prefix kernel, serialized suffix, suffix partials, merge). Also the
    largest difference of the concurrent graph's output to the serialized graph's.
(b) Engine level: the GRPO-shaped rollout (16 prompts x 8 samples x (256 + 256), qwen3-0.6b
    random bf16, CUDA graphs, cascade on; ``bench/fused_kv_write.py``'s engine) with the rule off
    and on, two engines in one process (``cascade.CASCADE_RULE`` set before each build: the graphs
    read it at capture; and before each run: eager steps read it per call), alternating
    ``--repeats`` times, tokens/s after one warm-up run; then 16 prompts x 8 greedy samples x 64
    tokens on both: whether the tokens are the same.

    python bench/cascade_concurrent.py --json bench/results/cascade_concurrent_h200.json   # ~1.5 min, one H200
    TRITON_INTERPRET=1 python bench/cascade_concurrent.py --tiny   # CPU: tiny shapes, checks it runs (no timing)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from asyncrl.engine import cascade  # noqa: E402
from asyncrl.engine import triton_decode as td  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402

LAYERS = 28  # Qwen3-0.6B's layers: calls per graph
GRPO = dict(groups=16, n=8, prefix=256, suffixes=(1, 64, 256), page=64, Hq=16, Hkv=8, Dh=128)
TINY = dict(groups=2, n=3, prefix=8, suffixes=(1, 5), page=4, Hq=4, Hkv=2, Dh=16)
# the tiny shape's 4-token blocks need 4-token tiles (a 16-token tile would cross blocks: valid, slower)
TINY_RULE = dict(prefix_block_n=4, suffix_block_n=4, min_chunk_tokens=4)


class Case:
    """Inputs of one suffix length: ``layers`` K/V caches with the same tables, the plan on the device."""

    def __init__(self, shape: dict, suffix: int, layers: int, dtype: torch.dtype, device: str, rule):
        import cascade_decode

        cascade_decode.DEVICE = device  # its kernel_case allocates there
        q, kc, vc, bt, ctx = cascade_decode.kernel_case(suffix, shape["groups"], shape["n"], shape["prefix"], page=shape["page"],
                                         Hq=shape["Hq"], Hkv=shape["Hkv"], Dh=shape["Dh"], copies=layers,
                                         dtype=dtype)
        self.q, self.kc, self.vc = q.to(device), kc.to(device), vc.to(device)
        B = q.shape[0]
        _, mpt = cascade.tile_shape(shape["Hq"] // shape["Hkv"])
        plan = cascade.plan_cascade(bt, ctx, shape["page"], mpt, bs=B)
        plan.prefix_splits = cascade.prefix_splits_for(plan.num_tiles, shape["Hkv"], shape["prefix"],
                                                       td.num_sms(torch.device(device)), rule)
        packed = torch.from_numpy(plan.packed()).to(device)
        self.chunks, self.tiles_active = plan.prefix_splits, plan.num_tiles
        self.sfx, self.tiles = packed[:B], packed[B:].view(-1, 2 + mpt)
        self.bt, self.ctx = torch.from_numpy(bt).to(device), torch.from_numpy(ctx).to(device)
        self.scale = shape["Dh"] ** -0.5

    def args(self, i: int) -> tuple:
        return self.q, self.kc[i], self.vc[i], self.bt, self.ctx

    def attention(self, rule, i: int) -> torch.Tensor:
        return td.cascade_decode_attention(*self.args(i), self.sfx, self.tiles, self.scale, rule=rule)


def graph_us(fn, layers: int, replays: int) -> tuple[float, object]:
    """us per call of ``fn(layer)``: one graph of ``layers`` calls, replayed ``replays`` times between
    CUDA events. Returns (us, the last call's output)."""
    stream = torch.cuda.Stream()  # a capture stream with the engine's priority (0)
    with torch.cuda.stream(stream):
        for i in range(layers):
            fn(i)  # compile, allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [fn(i) for i in range(layers)]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / (replays * layers), 2), outs[-1]


def kernel_level(shape: dict, layers: int, replays: int, dtype: torch.dtype, device: str, base_fields: dict) -> dict:
    serial = cascade.CascadeLaunchRule(**base_fields)
    conc = dataclasses.replace(serial, concurrent_prefix=1)
    res = dict(rule=dataclasses.asdict(serial), layers=layers, replays=replays, per_suffix={})
    for s in shape["suffixes"]:
        case = Case(shape, s, layers, dtype, device, serial)
        row = dict(chunks=case.chunks, tiles=case.tiles_active)
        ref = case.attention(serial, 0)
        if device == "cuda":
            prefix = [td.launch_prefix(*case.args(i)[:4], case.tiles, case.scale, serial) for i in range(layers)]
            suffix = [td.launch_suffix_partials(*case.args(i), case.sfx, case.scale, conc) for i in range(layers)]
            out = torch.empty_like(case.q)
            row["serialized_us"], o_serial = graph_us(lambda i: case.attention(serial, i), layers, replays)
            row["concurrent_us"], o_conc = graph_us(lambda i: case.attention(conc, i), layers, replays)
            row["saved_us"] = round(row["serialized_us"] - row["concurrent_us"], 2)
            row["pieces_us"] = dict(
                prefix=graph_us(lambda i: td.launch_prefix(*case.args(i)[:4], case.tiles, case.scale, serial),
                                layers, replays)[0],
                serialized_suffix=graph_us(lambda i: td.launch_suffix(*case.args(i), case.sfx, case.tiles, case.scale,
                                                                      prefix[i], serial), layers, replays)[0],
                suffix_partials=graph_us(lambda i: td.launch_suffix_partials(*case.args(i), case.sfx, case.scale,
                                                                             conc), layers, replays)[0],
                merge=graph_us(lambda i: td.merge_cascade(prefix[i], suffix[i], case.sfx, case.tiles, out),
                               layers, replays)[0])
            # the last layer's output of each graph (the graphs computed layer LAYERS - 1)
            last = case.attention(serial, layers - 1)
            row["graph_max_abs_diff"] = float(f"{(o_conc.float() - o_serial.float()).abs().max().item():.3g}")
            row["graph_serialized_vs_eager"] = float(f"{(o_serial.float() - last.float()).abs().max().item():.3g}")
        eager = case.attention(conc, 0)  # eager: the side stream without a graph (CPU: in sequence)
        row["eager_max_abs_diff"] = float(f"{(eager.float() - ref.float()).abs().max().item():.3g}")
        res["per_suffix"][s] = row
        print("kernel", f"S={s}", json.dumps(row), flush=True)
    return res


def engine_level(repeats: int, tiny: bool) -> dict:
    """(b): rule off / on, one process, alternating; greedy agreement."""
    from asyncrl.engine import LLM, bench
    from asyncrl.types import SamplingParams

    dev = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    hf = bench.build_random_hf("tiny" if tiny else "qwen3-0.6b", dtype, dev, 4096)
    vocab = hf.config.vocab_size
    prompts_n, samples, plen, resp = (3, 4, 12, 6) if tiny else (16, 8, 256, 256)
    base = cascade.CASCADE_RULE
    rules = {"off": dataclasses.replace(base, concurrent_prefix=0), "on": dataclasses.replace(base, concurrent_prefix=1)}
    if tiny:
        rules = {k: dataclasses.replace(r, **TINY_RULE) for k, r in rules.items()}

    def build(mode: str):
        cascade.CASCADE_RULE = rules[mode]  # read by the decode graphs' capture (and eager steps)
        kw = dict(block_size=4, max_num_seqs=16, max_model_len=64) if tiny else \
            dict(block_size=64, max_num_seqs=512, max_model_len=4096, num_kv_blocks=2048)
        llm = LLM(hf, dtype=dtype, device=dev, **kw)
        if tiny:  # the CPU's run of the GPU decode path (tests/engine/test_decode_host_path.py): paged kernels + cascade
            r = llm.runner
            r.cascade = cascade.CascadeBuffers(r.num_heads, r.num_kv_heads, r.block_size, llm.config.max_num_seqs,
                                               r.device)
            r.is_cuda = True
        llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
        return llm

    engines = {mode: build(mode) for mode in rules}
    if not tiny:
        assert td._SIDE_STREAMS, "the 'on' engine's graphs never forked the side stream"
    prompts = bench._rand_prompts(prompts_n, plen, vocab, 2)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=resp, ignore_eos=True)
    bench.WARMUP_RUNS = 0 if tiny else 1
    runs: dict[str, list] = {mode: [] for mode in rules}
    for _ in range(repeats):
        for mode, llm in engines.items():
            cascade.CASCADE_RULE = rules[mode]
            steps0 = llm.runner.cascade.steps
            r = bench.run_engine(llm, prompts, params, dev)
            r["cascade_steps"] = llm.runner.cascade.steps - steps0
            runs[mode].append(r)
            print("engine", mode, json.dumps(r), flush=True)
    greedy = SamplingParams(n=samples, temperature=0.0, max_tokens=resp if tiny else 64, ignore_eos=True)
    gp = bench._rand_prompts(prompts_n, plen, vocab, 7)
    tokens = {}
    for mode, llm in engines.items():
        cascade.CASCADE_RULE = rules[mode]
        tokens[mode] = [[c.token_ids for c in o.completions] for o in llm.generate(gp, greedy)]
    cascade.CASCADE_RULE = base
    pairs = [(a, b) for x, y in zip(tokens["off"], tokens["on"]) for a, b in zip(x, y)]
    same = sum(a == b for a, b in pairs)
    # bf16 + random weights: near-tied logits, so a rounding flip may change a greedy token; where they part
    common = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a)) for a, b in pairs]
    med = {mode: statistics.median(r["tokens_per_s"] for r in rs) for mode, rs in runs.items()}
    best = {mode: max(r["tokens_per_s"] for r in rs) for mode, rs in runs.items()}
    for llm in engines.values():
        bench._free(llm)
    return dict(runs=runs, median_tokens_per_s=med, best_tokens_per_s=best,
                speedup_median=round(med["on"] / med["off"], 4),
                greedy_identical_completions=f"{same}/{len(pairs)}",
                greedy_common_prefix_tokens=dict(min=min(common), mean=round(sum(common) / len(common), 1),
                                                 of=len(pairs[0][0])))


def _interpreter_index_on_numpy_2() -> None:
    """As tests/engine/test_triton_decode.py's fixture: Triton 3.6's interpreter turns a loaded scalar
    into a loop bound with ``int(array)``, which numpy >= 2.3 refuses for 1-element arrays."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--replays", type=int, default=50, help="graph replays per timing (each LAYERS calls)")
    ap.add_argument("--repeats", type=int, default=2, help="engine off/on rounds")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes, no timing")
    args = ap.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--tiny runs the kernels through the Triton interpreter: set TRITON_INTERPRET=1")
    if args.tiny:
        _interpreter_index_on_numpy_2()
    out = dict(provenance(" ".join(sys.argv)), env=os.environ.get("ASYNCRL_CASCADE_LAUNCH", ""))
    if args.tiny:
        out["device"] = "cpu (interpreter)"
    t0 = time.time()
    if not args.skip_kernel:
        shape, dtype, device = (TINY, torch.float32, "cpu") if args.tiny else (GRPO, torch.bfloat16, "cuda")
        out["kernel"] = kernel_level(shape, 2 if args.tiny else LAYERS, args.replays, dtype, device,
                                     TINY_RULE if args.tiny else {})
        print(f"kernel level: {time.time() - t0:.0f} s", flush=True)
    if not args.skip_engine:
        out["engine"] = engine_level(1 if args.tiny else args.repeats, args.tiny)
        print("engine", json.dumps({k: v for k, v in out["engine"].items() if k != "runs"}), flush=True)
    summary = {s: {k: row.get(k) for k in ("serialized_us", "concurrent_us", "saved_us", "graph_max_abs_diff",
                                           "eager_max_abs_diff")}
               for s, row in out.get("kernel", {}).get("per_suffix", {}).items()}
    print("summary", json.dumps(dict(kernel=summary, **{k: v for k, v in out.get("engine", {}).items()
                                                        if k != "runs"})), flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
