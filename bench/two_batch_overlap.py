"""Probe: does a decode step's trunk run faster as two half-batches on two streams?

At workload (a)'s shape (256 rows, ~260-512 tokens of context) the paged attention reads K/V at
the card's bandwidth while the GEMMs and glue of a layer are latency-bound on few SMs. Splitting
the rows in two halves lets one half's attention (bandwidth) run beside the other half's GEMMs
(compute), the "two-batch overlap" of SGLang and NanoFlow's nano-batches. This measures the
decoder trunk (``model.model``: every layer, no LM head) of the random-weight qwen3-0.6b in CUDA
graphs, each arrangement replayed in turn:

  full       one forward of all rows (the engine today)
  halves     the two halves one after the other on one stream
  free       the two halves on two streams, no edges between them
  phased     two streams; the attention kernels alternate A0 B0 A1 B1 ... (edges), so one half's
             GEMMs and glue run while the other half attends
  phased3    phased, with the attentions on a third, low-priority stream and each half's GEMMs
             and glue on high-priority streams (the block scheduler then serves the GEMMs first)

    python bench/two_batch_overlap.py --ctx 260,384,512 --json bench/results/two_batch_overlap.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.attention import AttentionMetadata, attend_cached  # noqa: E402
from asyncrl.engine.bench import build_random_hf, provenance, write_json  # noqa: E402
from asyncrl.engine.triton_qkv import qkv_to_cache  # noqa: E402

BLOCK = 64


def decode_inputs(rows: int, ctx_lo: int, ctx_hi: int, scratch: int, device: str, seed: int = 0) -> dict:
    """Graph buffers of one decode step: each row a random context in [ctx_lo, ctx_hi], its own
    blocks (shuffled), the new token's slot at its last position."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(ctx_lo, ctx_hi + 1, (rows,), generator=g, dtype=torch.int32)
    width = (ctx_hi + BLOCK - 1) // BLOCK
    blocks = torch.randperm(scratch, generator=g)[:rows * width].view(rows, width).to(torch.int32)
    pos = (ctx - 1).long()
    slots = blocks[torch.arange(rows), pos // BLOCK].long() * BLOCK + pos % BLOCK
    return dict(ids=torch.randint(0, 1000, (rows,), generator=g).to(device), pos=pos.to(device),
                slots=slots.to(device), bt=blocks.to(device), ctx=ctx.to(device))


def meta_of(inp: dict, lo: int, hi: int) -> AttentionMetadata:
    """Paged-decode metadata of rows [lo, hi): the slices, and that half's own longest-first order."""
    ctx = inp["ctx"][lo:hi]
    order = torch.argsort(ctx, descending=True, stable=True).to(torch.int32)
    return AttentionMetadata(slot_mapping=inp["slots"][lo:hi], block_tables=inp["bt"][lo:hi], context_lens=ctx,
                             longest_first=order, paged_decode=True)


class Half:
    """One half's activations through the layer loop, split at the attention:
    ``pre`` (norm, qkv GEMM, q/k norm + RoPE + K/V write), ``attend``, ``post`` (o GEMM, norm, MLP)."""

    def __init__(self, model, inp: dict, lo: int, hi: int):
        self.model, self.trunk = model, model.model
        self.ids, self.pos = inp["ids"][lo:hi], inp["pos"][lo:hi]
        self.meta = meta_of(inp, lo, hi)
        self.x, self.residual, self.q = None, None, None

    def embed(self):
        self.x, self.residual = self.trunk.embed_tokens(self.ids), None

    def pre(self, layer):
        if self.residual is None:
            x, self.residual = layer.input_layernorm(self.x), self.x
        else:
            x, self.residual = layer.input_layernorm(self.x, self.residual)
        a = layer.self_attn
        qkv = a.qkv_proj(x)
        qn = a.q_norm.weight if a.q_norm is not None else None
        kn = a.k_norm.weight if a.k_norm is not None else None
        self.q = qkv_to_cache(qkv, self.pos, self.trunk.rotary_emb.cos, self.trunk.rotary_emb.sin, qn, kn, a.eps,
                              a.num_heads, a.num_kv_heads, a.head_dim, a.k_cache, a.v_cache, self.meta.slot_mapping)

    def attend(self, layer):
        a = layer.self_attn
        self.o = attend_cached(self.q, a.k_cache, a.v_cache, self.meta, a.scale)

    def post(self, layer):
        a = layer.self_attn
        x = a.o_proj(self.o.reshape(self.o.shape[0], a.q_size))
        x, self.residual = layer.post_attention_layernorm(x, self.residual)
        self.x = layer.mlp(x)

    def finish(self):
        return self.trunk.norm(self.x, self.residual)[0]


def run_half(model, inp, lo, hi):
    h = Half(model, inp, lo, hi)
    h.embed()
    for layer in model.model.layers:
        h.pre(layer)
        h.attend(layer)
        h.post(layer)
    return h.finish()


def _edge(src: torch.cuda.Stream, dst: torch.cuda.Stream):
    ev = torch.cuda.Event()
    ev.record(src)
    dst.wait_event(ev)


def run_phased(model, inp, rows, streams, attn_stream=None):
    """Two halves on ``streams`` (A, B); attentions alternate A_i, B_i, A_{i+1} ... On ``attn_stream``
    (if given) the attentions run there, fenced by edges from and to their half's stream."""
    main = torch.cuda.current_stream()
    h = rows // 2
    halves = [Half(model, inp, 0, h), Half(model, inp, h, rows)]
    for s in streams + ([attn_stream] if attn_stream else []):
        s.wait_stream(main)
    last_attn = None  # event after the previous attention (either half)
    for half, s in zip(halves, streams):
        with torch.cuda.stream(s):
            half.embed()
    for layer in model.model.layers:
        for half, s in zip(halves, streams):
            with torch.cuda.stream(s):
                half.pre(layer)
            a_s = attn_stream or s
            if attn_stream:
                _edge(s, a_s)
            if last_attn is not None:
                a_s.wait_event(last_attn)
            with torch.cuda.stream(a_s):
                half.attend(layer)
            last_attn = torch.cuda.Event()
            last_attn.record(a_s)
            if attn_stream:
                s.wait_event(last_attn)
            with torch.cuda.stream(s):
                half.post(layer)
    outs = []
    for half, s in zip(halves, streams):
        with torch.cuda.stream(s):
            outs.append(half.finish())
        main.wait_stream(s)
    if attn_stream:
        main.wait_stream(attn_stream)
    return torch.cat(outs)


def run_free(model, inp, rows, streams):
    main = torch.cuda.current_stream()
    h = rows // 2
    outs = []
    for (lo, hi), s in zip(((0, h), (h, rows)), streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(run_half(model, inp, lo, hi))
    for s in streams:
        main.wait_stream(s)
    return torch.cat(outs)


def arrangements(model, inp, rows):
    lo_prio, hi_prio = torch.cuda.Stream.priority_range()  # (least, greatest): greatest is the most urgent
    s2 = [torch.cuda.Stream(), torch.cuda.Stream()]
    s3 = [torch.cuda.Stream(priority=hi_prio), torch.cuda.Stream(priority=hi_prio)]
    attn = torch.cuda.Stream(priority=lo_prio)
    h = rows // 2
    return {
        "full": lambda: run_half(model, inp, 0, rows),
        "halves": lambda: torch.cat([run_half(model, inp, 0, h), run_half(model, inp, h, rows)]),
        "free": lambda: run_free(model, inp, rows, s2),
        "phased": lambda: run_phased(model, inp, rows, s2),
        "phased3": lambda: run_phased(model, inp, rows, s3, attn),
    }


def capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(graph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="256")
    ap.add_argument("--ctx", default="260,384,512", help="mean contexts: rows get [c - 100, c + 100] (>= 2)")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    llm = LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=BLOCK, max_num_seqs=512, max_model_len=4096,
              num_kv_blocks=6000, enforce_eager=True, **({"kv_cache_dtype": "fp8"} if args.kv == "fp8" else {}))
    model = llm.runner.model
    for layer in model.model.layers:  # finite K/V in every block
        layer.self_attn.k_cache.view(torch.uint8).fill_(0x30)
        layer.self_attn.v_cache.view(torch.uint8).fill_(0x30)
    out = dict(provenance(" ".join(sys.argv)), kv=args.kv, rows=[])
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for c in map(int, args.ctx.split(",")):
                inp = decode_inputs(rows, max(2, c - 100), c + 100, llm.runner.scratch_block, "cuda")
                graphs = {name: capture(fn) for name, fn in arrangements(model, inp, rows).items()}
                for g, _ in graphs.values():  # a capture runs nothing: replay before comparing
                    g.replay()
                torch.cuda.synchronize()
                ref = graphs["full"][1].float()
                diffs = {name: float((o.float() - ref).abs().max()) for name, (_, o) in graphs.items()}
                times = {name: [] for name in graphs}
                for _ in range(args.repeats):
                    for name, (g, _) in graphs.items():
                        times[name].append(time_graph(g, args.replays))
                row = dict(rows=rows, ctx=c, ms={n: round(statistics.median(t), 4) for n, t in times.items()},
                           max_abs_diff=diffs)
                base = row["ms"]["full"]
                row["speedup"] = {n: round(base / t, 3) for n, t in row["ms"].items()}
                print(row, flush=True)
                out["rows"].append(row)
                del graphs
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
