"""The layer glue kernels end to end: workloads (a) and (c) with the tiled q/k norm + RoPE + K/V write launch
(``triton_qkv.qkv_launch``), the Triton SwiGLU (``decoder.TRITON_SILU``) and the Triton residual add + RMSNorm
(``decoder.TRITON_NORM``) against the kernels before them.

Variants (the first is the baseline): ``before``: one token per qkv program on one warp, the compiled torch
SiLU and RMSNorm (Inductor), the engine until 2026-12-04 session 48; ``silu``: the Triton SiLU only;
``both``: the tiled qkv launch and the Triton SiLU; ``all``: those and the Triton RMSNorm, the engine's
default off Hopper (torch's GEMMs); ``gemm``: ``all`` with the decode layers' GEMMs through ``triton_gemm``
(``decoder.TRITON_GEMM``: the norms, residual adds, SwiGLU and the q/k norm + RoPE + K/V write inside the GEMMs,
the norms in the GEMMs' prologues); ``gemm_noqkv``: the same
with ``triton_qkv``'s kernel after the qkv GEMM (``decoder.TRITON_GEMM_QKV`` off); ``lmhead``: ``all`` with the
sampling decode graphs' LM head + sampler as one kernel (``model_runner.FUSED_LM_HEAD_SAMPLER``, opt-in);
``gemm_lmhead``: both; ``gemm_pdl`` / ``gemm_lmhead_pdl``: those with the fused layers' kernels launched by
programmatic dependent launch, each GEMM's weights prefetched into L2 before it waits (``engine/pdl.py``, opt-in);
``gemm_folded`` / ``gemm_folded_noqkv`` / ``gemm_folded_pdl``: ``gemm`` / ``gemm_noqkv`` / ``gemm_pdl`` with the
RMSNorm weights folded into qkv and gate_up (``decoder.FOLD_NORMS``: plain TMA GEMMs, the row scale in their
epilogues); ``gemm_folded`` is the engine's default on Hopper (session 57).
One engine per variant (fixed KV pools, all held at once), the variant set while its engine
captures its CUDA graphs and before each of its runs, interleaved repeats of ``asyncrl bench rollout``'s workloads
after one untimed run of each (``engine.bench.interleaved_ab``). GPU only.

    python bench/glue_ab.py --json bench/results/glue_ab_h200.json   # ~4 min on an H200
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import model_runner, pdl, triton_qkv  # noqa: E402
from asyncrl.engine.bench import provenance, write_json  # noqa: E402
from asyncrl.engine.models import decoder  # noqa: E402

ENGINE_QKV_LAUNCH = triton_qkv.qkv_launch


def _one_token_launch(tokens: int) -> tuple[int, int]:
    return (1, 1)


def variant(qkv_tiled: bool, triton_silu: bool, triton_norm: bool, triton_gemm: bool = False,
            qkv_epilogue: bool = True, fused_head: bool = False, pdl_launch: bool = False, fold_norms: bool = False):
    """A no-argument switch of the module-level choices the engine reads at capture and at eager steps; its
    ``settings`` ({module: {name: value}}) name every switch it sets."""
    settings = {triton_qkv: dict(qkv_launch=ENGINE_QKV_LAUNCH if qkv_tiled else _one_token_launch),
                decoder: dict(TRITON_SILU=triton_silu, TRITON_NORM=triton_norm, TRITON_GEMM=triton_gemm,
                              TRITON_GEMM_QKV=qkv_epilogue, FOLD_NORMS=fold_norms),
                model_runner: dict(FUSED_LM_HEAD_SAMPLER=fused_head), pdl: dict(ENABLED=pdl_launch)}

    def apply() -> None:
        for module, values in settings.items():
            for name, value in values.items():
                setattr(module, name, value)
    apply.settings = settings
    return apply


VARIANTS = {"before": variant(False, False, False), "silu": variant(False, True, False),
            "both": variant(True, True, False), "all": variant(True, True, True),
            "gemm": variant(True, True, True, True), "gemm_noqkv": variant(True, True, True, True, False),
            "lmhead": variant(True, True, True, fused_head=True),
            "gemm_lmhead": variant(True, True, True, True, fused_head=True),
            "gemm_pdl": variant(True, True, True, True, pdl_launch=True),
            "gemm_lmhead_pdl": variant(True, True, True, True, fused_head=True, pdl_launch=True),
            "gemm_folded": variant(True, True, True, True, fold_norms=True),
            "gemm_folded_noqkv": variant(True, True, True, True, False, fold_norms=True),
            "gemm_folded_pdl": variant(True, True, True, True, pdl_launch=True, fold_norms=True)}


def run(repeats: int, kv_dtypes: list[str], blocks: int, names: list[str]) -> dict:
    from asyncrl.engine.bench import workloads_ab

    with contextlib.ExitStack() as restore:  # the engine's own choices back afterwards
        for module, values in VARIANTS[names[0]].settings.items():
            restore.enter_context(mock.patch.multiple(module, **{name: getattr(module, name) for name in values}))
        return workloads_ab({n: VARIANTS[n] for n in names}, kv_dtypes, blocks, repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--variants", default="before,both,all", help=f"of {sorted(VARIANTS)}; the first is the baseline")
    ap.add_argument("--blocks", type=int, default=4500,
                    help="KV blocks per engine; every variant's engine is held at once")
    args = ap.parse_args()
    out = provenance("python bench/glue_ab.py " + " ".join(sys.argv[1:]))
    out["engine"] = run(args.repeats, args.kv.split(","), args.blocks, args.variants.split(","))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
