"""What a NEW shape costs on the engine's gathered attention path (GPU prefill, speculative catch-ups).

Each call below has a shape not seen before in the process and is timed alone (synchronized):
  1. the engine's compiled glue (``decoder.rms_norm``, ``decoder.qkv_prepare``, torch.compile with
     dynamic shapes) over new token counts: recompiles would show here;
  2. masked ``F.scaled_dot_product_attention`` (bf16, [8, 16, Lq, Lk], the gathered path's bool
     mask) with torch's default backend choice, then with cuDNN's backend off;
  3. the engine's ``gathered_attention`` itself (which turns cuDNN's backend off, attention.py).
The first call of each series pays one-time loading; read the ones after it.

    python bench/sdpa_shape_cost.py            # one GPU, ~30 s
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's asyncrl, without an install
from asyncrl.engine import attention  # noqa: E402
from asyncrl.engine.models import decoder  # noqa: E402

DEV = "cuda"


def ms(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - started) * 1e3, 2)


def masked_sdpa(Lq: int, Lk: int, B: int = 8, H: int = 16, D: int = 128):
    q = torch.randn(B, H, Lq, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B, H, Lk, D, device=DEV, dtype=torch.bfloat16)
    j = torch.arange(Lk, device=DEV)
    last = torch.arange(Lq, device=DEV) + Lk - Lq
    mask = (j[None, None, :] <= last[None, :, None]).unsqueeze(1).expand(B, 1, Lq, Lk)
    return lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask)


def gathered(n: int, B: int = 8, H: int = 16, Hkv: int = 8, D: int = 128, bs: int = 16):
    cache = torch.randn(400, bs, Hkv, D, device=DEV, dtype=torch.bfloat16)
    tables = [list(range(b * 40, b * 40 + 40)) for b in range(B)]
    meta = attention.build_gathered_metadata(tables, [500 + b for b in range(B)], [n] * B, bs, 399, DEV)
    q = torch.randn(B * n, H, D, device=DEV, dtype=torch.bfloat16)
    return lambda: attention.gathered_attention(q, cache, cache, meta, D ** -0.5)


def main() -> dict:
    hidden = 1024
    w = torch.ones(hidden, device=DEV, dtype=torch.bfloat16)
    qkv = torch.randn(4096, 32 * 128, device=DEV, dtype=torch.bfloat16)
    cos, sin = torch.randn(8192, 128, device=DEV), torch.randn(8192, 128, device=DEV)
    qn = torch.ones(128, device=DEV, dtype=torch.bfloat16)
    tokens = (300, 301, 517, 1033, 2049, 4011, 777, 778)
    out = {
        "rms_norm_compiled_ms": [ms(lambda: decoder.rms_norm(torch.randn(T, hidden, device=DEV, dtype=torch.bfloat16),
                                                             w, 1e-6)) for T in tokens],
        "qkv_prepare_compiled_ms": [ms(lambda: decoder.qkv_prepare(qkv[:T], torch.arange(T, device=DEV), cos, sin,
                                                                   qn, qn, 1e-6, 16, 8, 128)) for T in tokens],
        "sdpa_masked_default_ms": [ms(masked_sdpa(*s)) for s in
                                   ((37, 1500), (61, 1700), (128, 2100), (255, 2200), (511, 2300), (62, 1701))],
    }
    torch.backends.cuda.enable_cudnn_sdp(False)
    out["sdpa_masked_cudnn_off_ms"] = [ms(masked_sdpa(*s)) for s in
                                       ((39, 1502), (63, 1702), (129, 2101), (257, 2203), (513, 2301))]
    torch.backends.cuda.enable_cudnn_sdp(True)
    out["engine_gathered_attention_ms"] = [ms(gathered(n)) for n in (37, 61, 128, 255, 511, 62, 38)]
    out["dynamo"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "recompiles")}
    for key, value in out.items():
        print(key, value)
    return out


if __name__ == "__main__":
    main()
