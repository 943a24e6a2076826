"""A decode layer's GEMMs and glue, the engine's kernels against ``triton_gemm``'s (the glue inside the GEMMs).

Times, in CUDA graphs (``triton.testing.do_bench_cudagraph``), a stack of ``--layers`` decoder layers without their
attention kernel (its output is a fixed tensor, so every chain does the same work around it) at ``M`` rows:

  engine              add + RMSNorm (``triton_norm``), qkv ``F.linear``, q/k norm + RoPE + K/V write
                      (``triton_qkv``), o ``F.linear``, add + RMSNorm, gate_up ``F.linear``, SwiGLU (``triton_silu``),
                      down ``F.linear``: eight kernels a layer (nine with attention)
  fused               ``norm_linear`` (qkv), ``triton_qkv``, ``linear_residual`` (o), ``norm_linear`` + SwiGLU
                      (gate_up), ``linear_residual`` (down): five (six)
  fused_qkv_epilogue  the same with ``norm_qkv_to_cache`` for the first two: four (five)
  fused_qkv_epilogue_pdl  the same launched by programmatic dependent launch, each GEMM's weights prefetched into
                      L2 while the kernel before it runs (``engine/pdl.py``)

and reports us per layer, each chain's ratio to the engine's and the max abs difference of its last hidden state
and last q from the engine's. Then each fused kernel
alone over a sweep of tiles / warps / stages (``--sweep``), against the engine's ``triton_gemm.LAUNCH``: what to
set there. Shapes: Qwen3-0.6B (``--shape 0.6b``) or Qwen3-8B (``8b``); bf16.

    python bench/fused_layer.py --ms 256,128,64 --sweep --json bench/results/fused_layer.json   # ~3 min, H200
    python bench/fused_layer.py --ms 256 --pdl-stages 2,3   # the PDL chain at fewer pipeline stages
    python bench/fused_layer.py --offline   # no GPU: each kernel compiled for sm90, its registers / spills / smem
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

# hidden, intermediate, query heads, kv heads, head dim
SHAPES = {"0.6b": (1024, 3072, 16, 8, 128), "8b": (4096, 12288, 32, 8, 128)}
EPS = 1e-6


def layer_weights(shape: str, layers: int, g: torch.Generator, dtype=torch.bfloat16) -> list[dict]:
    """Random weights of ``layers`` layers of ``SHAPES[shape]`` on g's device."""
    hidden, inter, H, Hkv, D = SHAPES[shape]

    def w(n, k):
        return (torch.randn(n, k, device=g.device, generator=g) / k ** 0.5).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, device=g.device, generator=g)).to(dtype)

    return [dict(qkv=w((H + 2 * Hkv) * D, hidden), o=w(hidden, H * D), gate_up=w(2 * inter, hidden),
                 down=w(hidden, inter), ln1=norm(hidden), ln2=norm(hidden), q_norm=norm(D), k_norm=norm(D))
            for _ in range(layers)]


class Step:
    """What a decode step's layers share besides weights: ``M`` rows at distinct cache slots and positions < 512, the
    RoPE tables, one K/V cache (64-token pages) the layers all write (the same slots: the bench times, not serves),
    and attention's output, a fixed ``[M, H D]`` tensor standing in for the attention kernels both chains run."""

    def __init__(self, shape: str, M: int, g: torch.Generator, dtype=torch.bfloat16):
        hidden, self.inter, self.H, self.Hkv, self.D = SHAPES[shape]
        dev = g.device
        self.positions = torch.randint(0, 512, (M,), device=dev, generator=g)
        blocks = M // 64 + 2
        self.slots = torch.randperm(blocks * 64, device=dev, generator=g)[:M]
        inv = 1.0 / (1e6 ** (torch.arange(0, self.D, 2, dtype=torch.float, device=dev) / self.D))
        emb = torch.outer(torch.arange(512, dtype=torch.float, device=dev), inv).repeat(1, 2)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.k_cache = torch.zeros(blocks + 1, 64, self.Hkv, self.D, device=dev, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.x = torch.randn(M, hidden, device=dev, generator=g).to(dtype)
        self.attn_out = torch.randn(M, self.H * self.D, device=dev, generator=g).to(dtype)

    def qkv_to_cache(self, qkv, lw):
        from asyncrl.engine.triton_qkv import qkv_to_cache

        return qkv_to_cache(qkv, self.positions, self.cos, self.sin, lw["q_norm"], lw["k_norm"], EPS, self.H,
                            self.Hkv, self.D, self.k_cache, self.v_cache, self.slots)


def engine_chain(step: Step, layers: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's kernels today (``decoder.DecoderLayer.forward``, attention's output fixed): (the last hidden
    state, the last layer's q)."""
    from asyncrl.engine.triton_norm import rms_norm
    from asyncrl.engine.triton_silu import silu_and_mul

    h, residual = rms_norm(step.x, layers[0]["ln1"], EPS), step.x
    for i, lw in enumerate(layers):
        if i:
            h, residual = rms_norm(h, lw["ln1"], EPS, residual)
        q = step.qkv_to_cache(F.linear(h, lw["qkv"]), lw)
        h, residual = rms_norm(F.linear(step.attn_out, lw["o"]), lw["ln2"], EPS, residual)
        h = F.linear(silu_and_mul(F.linear(h, lw["gate_up"]), step.inter), lw["down"])
    return h.float() + residual.float(), q  # the final norm's input, unrounded


def fused_chain(step: Step, layers: list[dict], qkv_epilogue: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``decoder.DecoderLayer.forward_fused`` (attention's output fixed): the q/k norm + RoPE + K/V write in the qkv
    GEMM's epilogue, or (``qkv_epilogue=False``) ``triton_qkv``'s kernel after ``norm_linear``."""
    from asyncrl.engine.triton_gemm import linear_residual, norm_linear, norm_qkv_to_cache, sum_squares

    h, ss = step.x, sum_squares(step.x)
    for lw in layers:
        if qkv_epilogue:
            q = norm_qkv_to_cache(h, ss, lw["ln1"], lw["qkv"], EPS, step.positions, step.cos, step.sin, lw["q_norm"],
                                  lw["k_norm"], EPS, step.H, step.Hkv, step.D, step.k_cache, step.v_cache, step.slots)
        else:
            q = step.qkv_to_cache(norm_linear(h, ss, lw["ln1"], lw["qkv"], EPS), lw)
        h, ss = linear_residual(step.attn_out, lw["o"], h)
        h, ss = linear_residual(norm_linear(h, ss, lw["ln2"], lw["gate_up"], EPS, inter=step.inter), lw["down"], h)
    return h.float(), q


def fold_layers(layers: list[dict]) -> list[dict]:
    """Each layer's qkv and gate_up weights with the norms before them folded in (``triton_gemm.fold_norm``)."""
    from asyncrl.engine.triton_gemm import fold_norm

    return [dict(lw, qkv=fold_norm(lw["qkv"], lw["ln1"]), gate_up=fold_norm(lw["gate_up"], lw["ln2"])) for lw in layers]


def folded_chain(step: Step, folded: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_fused`` under ``decoder.FOLD_NORMS`` (``folded``: ``fold_layers``'s weights): qkv (its epilogue
    included) and gate_up as plain TMA GEMMs with the row scale after the K loop."""
    from asyncrl.engine.triton_gemm import linear_residual, norm_linear, norm_qkv_to_cache, sum_squares

    h, ss = step.x, sum_squares(step.x)
    for lw in folded:
        q = norm_qkv_to_cache(h, ss, None, lw["qkv"], EPS, step.positions, step.cos, step.sin, lw["q_norm"],
                              lw["k_norm"], EPS, step.H, step.Hkv, step.D, step.k_cache, step.v_cache, step.slots,
                              folded=True)
        h, ss = linear_residual(step.attn_out, lw["o"], h)
        act = norm_linear(h, ss, None, lw["gate_up"], EPS, inter=step.inter, folded=True)
        h, ss = linear_residual(act, lw["down"], h)
    return h.float(), q


def pdl_chain(step: Step, layers: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_chain`` with its kernels launched by programmatic dependent launch, each GEMM's weight rows prefetched
    into L2 before it waits for the kernel before (``engine/pdl.py``)."""
    from asyncrl.engine import pdl

    on = pdl.ENABLED
    pdl.ENABLED = True
    try:
        return fused_chain(step, layers)
    finally:
        pdl.ENABLED = on


CHAINS = {"engine": engine_chain, "fused": lambda step, layers: fused_chain(step, layers, False),
          "fused_qkv_epilogue": fused_chain, "fused_qkv_epilogue_pdl": pdl_chain}


def configs() -> list[tuple]:
    """(BM, BN, BK, warps, stages) candidates."""
    tiles = itertools.product((64, 128), (32, 64, 128), (64, 128))
    return [(bm, bn, bk, w, s) for (bm, bn, bk), (w, s) in itertools.product(tiles, ((4, 3), (4, 4), (8, 3)))]


def sweep_kernels(step: Step, lw: dict) -> list[dict]:
    """Each fused kernel at the step's rows over ``configs()``: the engine's launch and the fastest, us (CUDA
    graphs; the qkv epilogue kernel's column tile is the head, so its sweep varies the rest)."""
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine.triton_gemm import launch, linear_residual, norm_linear, norm_qkv_to_cache

    M, (hidden, H, D) = step.x.shape[0], (step.x.shape[1], step.H, step.D)
    h, a_o = step.x, step.attn_out
    a_down = torch.randn(M, step.inter, device=h.device, dtype=h.dtype)
    ss = linear_residual(a_o, lw["o"], h)[1]
    qkv_epilogue = lambda c: norm_qkv_to_cache(  # noqa: E731
        h, ss, lw["ln1"], lw["qkv"], EPS, step.positions, step.cos, step.sin, lw["q_norm"], lw["k_norm"], EPS, H,
        step.Hkv, D, step.k_cache, step.v_cache, step.slots, config=c)
    cases = {
        "qkv (norm prologue)": ("norm", hidden, lw["qkv"].shape[0],
                                lambda c: norm_linear(h, ss, lw["ln1"], lw["qkv"], EPS, config=c)),
        "qkv (norm prologue, q/k norm + RoPE + K/V write epilogue)": ("qkv_cache", hidden, lw["qkv"].shape[0],
                                                                      qkv_epilogue),
        "gate_up (norm + SwiGLU)": ("swiglu", hidden, step.inter, lambda c: norm_linear(
            h, ss, lw["ln2"], lw["gate_up"], EPS, inter=step.inter, config=c)),
        "o (residual epilogue)": ("residual", H * D, hidden, lambda c: linear_residual(a_o, lw["o"], h, config=c)),
        "down (residual epilogue)": ("residual", step.inter, hidden,
                                     lambda c: linear_residual(a_down, lw["down"], h, config=c)),
    }
    rows = []
    for name, (kind, K, N, run) in cases.items():
        engine = launch(kind, K, N)
        candidates = [engine] + [c for c in configs() if c != engine]
        if kind == "qkv_cache":  # BN is the head: drop the duplicates that differ in it only
            candidates = list({(bm, D, bk, w, st): None for bm, _, bk, w, st in candidates})
            engine = candidates[0]
        timed = {}
        for config in candidates:
            try:
                timed[config] = do_bench_cudagraph(lambda: run(config), rep=20) * 1e3
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                print(f"  {name} {config}: {repr(exc)[:100]}", flush=True)
        best = min(timed, key=timed.get)
        rows.append(dict(m=M, kernel=name, engine_launch=engine, engine_us=round(timed[engine], 2),
                         best=best, best_us=round(timed[best], 2)))
        print(rows[-1], flush=True)
    return rows


def sweep_pdl_stages(step: Step, layers: list[dict], stages: str, n_layers: int) -> list[dict]:
    """``pdl_chain`` with every ``triton_gemm.LAUNCH`` entry at each of ``stages`` (comma-separated): under PDL a
    GEMM's programs start early only where the SM has room beside the kernel before it, so fewer stages (less
    shared memory) may pay in the chain though not alone. us per layer, each against the default stages."""
    from triton.testing import do_bench_cudagraph

    from asyncrl.engine import triton_gemm

    default = dict(triton_gemm.LAUNCH)
    rows = []
    try:
        for count in [None] + [int(c) for c in stages.split(",")]:
            triton_gemm.LAUNCH.update({k: v[:4] + (count,) for k, v in default.items()} if count else default)
            us = do_bench_cudagraph(lambda: pdl_chain(step, layers), rep=50) * 1e3 / n_layers
            rows.append(dict(m=step.x.shape[0], stages=count or "default", us_per_layer=round(us, 2)))
            print(rows[-1], flush=True)
    finally:
        triton_gemm.LAUNCH.update(default)
    return rows


def offline(shape: str, pdl: bool = False) -> list[dict]:
    """The engine's launch of each fused kernel at ``shape`` compiled for sm90 (``bench/sm90_offline.py``): registers,
    stack, spills (LOCAL) and shared memory, without a GPU. ``pdl``: as launched under ``engine/pdl.py``
    (``USE_PDL``: the weight prefetch and the grid-dependency wait)."""
    from sm90_offline import compile_sm90, first_instructions, register_usage

    from asyncrl.engine import triton_gemm as tg

    hidden, inter, H, Hkv, D = SHAPES[shape]
    qkv = (H + 2 * Hkv) * D
    rows = []
    for name, kind, K, N in (("qkv", "norm", hidden, qkv), ("qkv epilogue", "qkv_cache", hidden, qkv),
                             ("gate_up", "swiglu", hidden, inter), ("o", "residual", H * D, hidden),
                             ("down", "residual", inter, hidden), ("qkv folded", "folded", hidden, qkv),
                             ("qkv epilogue folded", "folded_qkv_cache", hidden, qkv),
                             ("gate_up folded", "folded_swiglu", hidden, inter)):
        bm, bn, bk, warps, stages = tg.launch(kind, K, N)
        consts = dict(BM=bm, BK=bk, PREC="tf32", USE_PDL=pdl)
        if kind != "residual":
            consts["FOLDED"] = kind.startswith("folded")
        h_desc = f"tensordesc<bf16[{bm}, {bk}]>"
        if kind == "residual":
            kernel, consts["BN"] = tg._linear_residual_kernel, bn
            sig = dict(a_desc=h_desc, w_desc=f"tensordesc<bf16[{bn}, {bk}]>", W="*bf16", RES="*bf16", H="*bf16",
                       SS="*fp32", M="i32", N="i32", K="i32", stride_res="i32", stride_h="i32", stride_ss="i32")
        elif name.startswith("qkv epilogue"):
            kernel, bn = tg._norm_qkv_cache_kernel, D
            consts |= dict(H=H, HKV=Hkv, D=D, HALF=D // 2, BP=32, NORM=True, BIAS=False, FP8=False, FP8_MAX=448.0)
            sig = dict(h_desc=h_desc, SS="*fp32", NW="*bf16", w_desc=f"tensordesc<bf16[{D // 2}, {bk}]>", W="*bf16",
                       B="*bf16", POS="*i64", COS="*fp32", SIN="*fp32", QW="*bf16", KW="*bf16", Q="*bf16", KC="*bf16",
                       VC="*bf16",
                       SLOT="*i64", M="i32", K="i32", P="i32", eps="fp32", head_eps="fp32", stride_ss="i32",
                       stride_qt="i32", stride_qh="i32", stride_rope="i32", stride_cs="i32", stride_ch="i32")
        else:
            kernel = tg._norm_linear_kernel
            consts |= dict(BN=bn, BP=32, SWIGLU=kind.endswith("swiglu"), BIAS=False)
            sig = dict(h_desc=h_desc, SS="*fp32", NW="*bf16", w_desc=f"tensordesc<bf16[{bn}, {bk}]>", W="*bf16",
                       B="*bf16", C="*bf16", M="i32", N="i32", K="i32", P="i32", eps="fp32", stride_ss="i32",
                       stride_c="i32", INTER="i32")
        sig |= {k: "constexpr" for k in consts}
        compiled = compile_sm90(kernel, sig, consts, {}, warps, stages)
        rows.append(dict(kernel=name, launch=(bm, bn, bk, warps, stages), pdl=pdl, usage=register_usage(compiled),
                         shared_bytes=compiled.metadata.shared,
                         l2_prefetches=compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2"),
                         first=first_instructions(compiled, ("UBLKPF", "ACQBULK", "UTMALDG", "LDG", "LDGSTS"))))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="256,128,64")
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers per timed graph (launch gaps included)")
    ap.add_argument("--sweep", action="store_true", help="also sweep each fused kernel's launch")
    ap.add_argument("--offline", action="store_true", help="compile for sm90 without a GPU and report resources")
    ap.add_argument("--pdl", action="store_true", help="with --offline: the kernels as launched under engine/pdl.py")
    ap.add_argument("--pdl-stages", default="", help="e.g. 2,3,4: the PDL chain with every fused kernel's pipeline "
                    "at each stage count (less shared memory: a GEMM's programs fit beside the one before it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.offline:
        write_json(args.json, dict(provenance(" ".join(sys.argv)), offline=offline(args.shape, args.pdl)))
        return 0
    from triton.testing import do_bench_cudagraph

    out = dict(provenance(" ".join(sys.argv)), chains=[], sweeps=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = layer_weights(args.shape, args.layers, g)
    folded = fold_layers(layers)
    for M in map(int, args.ms.split(",")):
        step = Step(args.shape, M, g)
        ref_h, ref_q = engine_chain(step, layers)
        row = dict(m=M, shape=args.shape)
        chains = dict(CHAINS, fused_folded=lambda step, _: folded_chain(step, folded))
        for name, chain in chains.items():
            h, q = chain(step, layers)
            us = do_bench_cudagraph(lambda: chain(step, layers), rep=50) * 1e3 / args.layers
            row[name] = dict(us_per_layer=round(us, 2), max_abs_diff_last_hidden=(h - ref_h).abs().max().item(),
                             max_abs_diff_q=(q.float() - ref_q.float()).abs().max().item())
        for name in chains:
            row[name]["x_engine"] = round(row["engine"]["us_per_layer"] / row[name]["us_per_layer"], 3)
        print(row, flush=True)
        out["chains"].append(row)
        if args.sweep:
            out["sweeps"] += sweep_kernels(step, layers[0])
        if args.pdl_stages:
            out.setdefault("pdl_stages", []).extend(sweep_pdl_stages(step, layers, args.pdl_stages, args.layers))
        write_json(args.json, out)  # after each row count: a device call cut at its time limit keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
