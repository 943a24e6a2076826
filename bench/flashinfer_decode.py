"""The engine's paged-decode attention against FlashInfer's, on the same cache (issue 23, GPU).

Issue 23 asks for decode attention at the bandwidth limit, "or a library kernel such as FlashInfer's where it
is faster: measure both". FlashInfer reads the engine's cache as it is: K and V are separate
``[blocks, page, kv heads, D]`` tensors, FlashInfer's "NHD" layout, so no copy is timed. One attention layer
of the Qwen3-0.6B shape (16 q heads, 8 kv heads, D 128, 64-token blocks scattered over the pool,
``paged_decode_sweep.case``) at workload (a)'s decode shapes (256 x 260 / 384 / 512) and workload (c)'s tail
(8 / 64 x 1,500 / 2,300), bf16 and e4m3 K/V. Rows: the engine's kernel (``DECODE_LAUNCH``), FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper`` on CUDA cores and with ``use_tensor_cores=True`` (its prefill kernel
with the GQA group as rows). Each is timed in a CUDA graph (``do_bench_cudagraph``: GPU time only; FlashInfer's
``plan`` runs once outside it, as an engine would run it once per step on the host), checked against the
engine's output (max abs diff), and reported in us and TB/s of K/V bytes read.

FlashInfer is not a dependency of asyncrl (its wheel is 101 MB with ~8 further packages); this bench takes
whatever ``import flashinfer`` finds, JIT-compiling its kernels with the machine's nvcc on first use:

    python bench/flashinfer_decode.py --json bench/results/flashinfer_decode_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paged_decode_variants import D, H, HKV, PAGE, REGIMES, cases, timed_row  # noqa: E402

from asyncrl.engine.bench import provenance, write_json  # noqa: E402


def flashinfer_inputs(bt: torch.Tensor, lens: torch.Tensor):
    """FlashInfer's CSR page table from the engine's block table ``bt`` [B, M] and ``lens`` [B]:
    (indptr [B + 1], indices [sum pages], last_page_len [B]), int32 on the device."""
    pages = (lens + PAGE - 1) // PAGE
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=bt.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(bt.shape[1], device=bt.device)[None, :]
    indices = bt[cols < pages[:, None]].to(torch.int32)  # row-major: each sequence's pages in order
    last = (lens - (pages - 1) * PAGE).to(torch.int32)
    return indptr, indices, last


def flashinfer_runner(flashinfer, q, k, v, bt, lens, tensor_cores: bool):
    """A zero-argument callable running FlashInfer's decode on the engine's cache (planned once)."""
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    indptr, indices, last = flashinfer_inputs(bt, lens)
    wrapper.plan(indptr, indices, last, H, HKV, D, PAGE, q_data_type=q.dtype, kv_data_type=k.dtype,
                 sm_scale=D ** -0.5)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k, v), out=out)


def measure(flashinfer) -> list[dict]:
    from asyncrl.engine.triton_decode import paged_decode_attention

    rows = []
    for fields, (q, k, v, bt, lens), kv_bytes in cases():
        ours = lambda: paged_decode_attention(q, k, v, bt, lens, D ** -0.5)  # noqa: E731
        ref = ours().float()
        candidates = {"engine": lambda: ours}
        if flashinfer is not None:
            candidates["flashinfer"] = lambda: flashinfer_runner(flashinfer, q, k, v, bt, lens, False)
            candidates["flashinfer tensor cores"] = lambda: flashinfer_runner(flashinfer, q, k, v, bt, lens, True)
        for name, make in candidates.items():
            rows.append(timed_row(dict(fields, kernel=name), make, ref, kv_bytes, name))
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (regime, kv dtype, kernel): us summed over the regime's shapes, and the ratio engine / kernel
    (> 1: the kernel is faster than the engine's)."""
    out = []
    for regime, shapes in REGIMES.items():
        for kv in sorted({r["kv"] for r in rows}):
            totals = {}
            for kernel in sorted({r["kernel"] for r in rows}):
                got = [r for r in rows if (r["regime"], r["kv"], r["kernel"]) == (regime, kv, kernel) and "us" in r]
                if len(got) == len(shapes):
                    totals[kernel] = sum(r["us"] for r in got)
            for kernel, us in totals.items():
                out.append(dict(regime=regime, kv=kv, kernel=kernel, us=round(us, 1),
                                engine_over_kernel=round(totals["engine"] / us, 3) if "engine" in totals else None))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows and the summary here")
    args = ap.parse_args()
    started = time.perf_counter()
    try:
        import flashinfer
        version = getattr(flashinfer, "__version__", "?")
    except Exception:  # noqa: BLE001 - the bench still times the engine's kernel alone
        traceback.print_exc()
        flashinfer, version = None, None
    print(f"flashinfer {version}; torch {torch.__version__}; {torch.cuda.get_device_name()}", flush=True)
    rows = measure(flashinfer)
    result = dict(provenance("python bench/flashinfer_decode.py " + " ".join(sys.argv[1:])), flashinfer=version,
                  rows=rows, summary=summary(rows), seconds=round(time.perf_counter() - started, 1))
    for line in result["summary"]:
        print("SUMMARY", json.dumps(line), flush=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
