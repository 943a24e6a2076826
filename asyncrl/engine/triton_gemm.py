"""A decode layer's four GEMMs with its glue inside them: the residual add and the RMSNorm statistics in the epilogue
of the GEMM that ends a sub-block (o_proj, down_proj), the RMSNorm itself in the prologue of the GEMM that starts the
next one (qkv_proj, gate_up_proj), SwiGLU in gate_up's epilogue, and the q/k norm + RoPE + K/V cache write in qkv's
epilogue. On by default on Hopper with the norms folded (``decoder.TRITON_GEMM`` None + ``FOLD_NORMS``, below):
workload (a) end to end 1.023x on an H100 (bf16 K/V; every interleaved repeat >= 1.02x), 1.018-1.023x with an FP8 K/V
cache, (c) 1.00x (bench/RESULTS.md, issue 23, session 57). With the norm in the prologue instead (``FOLD_NORMS`` off)
a layer takes 0.72x the engine's on an H200 (qkv 11.7 us, gate_up + SwiGLU 21.8, against cuBLAS's ~5.4 and ~7.0
alone) and (a) 0.93x, (c) 0.90x, so that form is not the default. The residual epilogues match cuBLAS (o 5.9 us,
down 7.5).

Why: at a decode step's few hundred rows every GEMM is latency-bound (~6-7 us on an H200 for Qwen3-0.6B's shapes,
``bench/blas_choice.py``) and a layer runs four glue kernels beside its four GEMMs (two residual add + RMSNorm,
SwiGLU, the q/k norm + RoPE + K/V write; ~2-3 us each plus a ~1 us gap before each, bench/RESULTS.md session 48).
cuBLAS takes no prologue or epilogue, so the glue needs GEMMs of our own; fed by the tensor-memory accelerator
(host-made tensor descriptors) a Triton GEMM matched cuBLAS at these shapes (0.97-1.08x, ``bench/fused_mlp_gemm.py``,
session 51). A layer is then

    q     = norm_qkv_to_cache(h, ss, input_layernorm.weight, W_qkv, ...)   # RMSNorm prologue; q/k norm, RoPE, K/V
    o     = attention(q)                                                     # the paged kernels, unchanged
    h, ss = linear_residual(o, W_o, h)                                       # h + o_proj(o); row sums of h^2 per tile
    act   = norm_linear(h, ss, post_attention_layernorm.weight, W_gate_up, inter=I)   # RMSNorm + SwiGLU
    h, ss = linear_residual(act, W_down, h)

five kernels where the engine runs nine (``norm_linear`` + ``triton_qkv`` in place of the first: six). ``h [T, N]``
is the hidden state itself (the residual stream with the sub-block's output added), ``ss [T, P]`` fp32 holds each
row's sum of ``h^2`` in ``P`` column-tile partials (written by the producing GEMM's ``P`` column programs, summed in
a fixed order by the consumer: deterministic, no atomics), so the consumer normalizes in one pass over ``h`` and no
program re-reads a row to find its norm.

Numbers: the engine's (``triton_norm``, ``triton_silu``, ``triton_qkv``, torch's linear): the GEMM output rounded to
the model dtype before the residual add, the sum rounded once; ``round(round(h * rsqrt(mean(h^2) + eps)) * w)`` fed
to the next GEMM; SwiGLU's ``round(round(silu(round(gate))) * round(up))``. Left to differ: the order of the mean's
sum (P partials of N / P values; a few fp32 ulps of rsqrt, inside one rounding of the model dtype) and the GEMMs' K
order. fp32 models multiply in IEEE fp32 (``input_precision="ieee"``), as torch does by default, not in TF32.

Folded norms (``decoder.FOLD_NORMS``, on): ``rmsnorm(h) @ W^T = r * (h @ (W diag(w))^T)`` with ``r =
rsqrt(mean(h^2) + eps)`` per row, so with ``fold_norm``'s ``W' = W diag(w)`` kept beside each qkv / gate_up weight the
two norm kernels become plain TMA GEMMs that scale their fp32 product by ``r`` after the K loop (``folded=True``).
Another rounding of the same product: the normed rows are never rounded to the model dtype, and W' is rounded once
(the mean |log-prob - HF's| at workload (a) 0.007374 against the unfolded engine's 0.007348). The copies cost the two
weights' bytes again (~0.6 GB at 0.6B, ~9 GB at 8B), made before the KV pool is sized.

Under ``engine/pdl.py`` (opt-in) each kernel launches by programmatic dependent launch: its first row tile's
programs prefetch the weight rows they multiply into L2, then every program waits for the kernel before and lets the
next one launch (``_weights_then_wait``), so a GEMM's weights stream during the previous kernel's tail.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from asyncrl.engine.attention import FP8_KV, FP8_KV_MAX
from asyncrl.engine.pdl import launch_options, prefetch_rows, wait_then_release
from asyncrl.engine.triton_qkv import _cache_slots, _norm_rope_head, _store_halves, cast_rn, check_tables, rsqrt_f32
from asyncrl.engine.triton_silu import swiglu_rn  # torch's CUDA silu (expf, an IEEE division), eager's roundings

# (row tile, column tile, K tile, warps, stages) per kernel kind, from bench/fused_layer.py --sweep at 256 rows on an
# H200 (2026-12-05, session 53; raw fused_layer_sweep_h200_2026-12-05.json): the norm prologue kernels at 4 warps and
# 3 stages (qkv 11.7 us; the qkv epilogue 11.7 us against 15.9 on 8 warps, though sm90 gives it 255 registers and a
# 264-byte stack there), o / down 64 x 32 x 128 (5.9 / 7.5 us), gate_up + SwiGLU 64 x 32 x 64 (21.8 us; the best,
# 64 x 128 x 64 on 8 warps, 21.6). The norm prologue is what keeps the path off: cuBLAS takes ~5.4 us for qkv and ~7.0
# for gate_up alone (bench/RESULTS.md, session 53).
# The folded kinds (``fold_norm``: plain TMA GEMMs, the row scale after the loop) from bench/folded_norm_gemm.py at 256
# rows (2026-12-05, session 54): qkv 64 x 128 x 128 on 4 warps, 4 stages (5.85 us against the engine's norm kernel +
# cuBLAS 7.48); gate_up + SwiGLU 64 x 32 x 64, 4 stages (9.5 us against 11.25); the qkv epilogue kernel as qkv.
LAUNCH = {"norm": (64, 128, 128, 4, 3), "swiglu": (64, 32, 64, 4, 4), "residual": (64, 32, 128, 4, 4),
          "qkv_cache": (64, 128, 128, 4, 3), "folded": (64, 128, 128, 4, 4), "folded_swiglu": (64, 32, 64, 4, 4),
          "folded_qkv_cache": (64, 128, 128, 4, 4)}
MAX_ROWS = 512  # above it (prefill) cuBLAS's large-tile kernels win; the engine keeps its torch GEMMs there


@triton.jit
def _prefetch_first_row_tile(W, row0, rows, K):
    """Weight rows ``[row0, row0 + rows)`` into L2, by the programs of the first row tile only (the others read
    the same rows: one prefetch of each suffices)."""
    if tl.program_id(0) == 0:
        prefetch_rows(W, row0, rows, K, W.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def _weights_then_wait(W, row0, rows, K, USE_PDL: tl.constexpr):
    """Under PDL (``engine/pdl.py``): this program's weight rows start streaming into L2, then it waits for the
    kernel before (whose outputs it reads) and lets the next kernel launch. No-op off."""
    if USE_PDL:
        _prefetch_first_row_tile(W, row0, rows, K)
    wait_then_release(USE_PDL)


@triton.jit
def _linear_residual_kernel(a_desc, w_desc, W, RES, H, SS, M, N, K, stride_res, stride_h, stride_ss,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
    """Program (row tile, column tile j): ``H = round(round(A @ W^T) + RES)`` on its tile, ``SS[:, j]`` = the tile's
    row sums of ``H^2`` (fp32). A ``[M, K]`` and W ``[N, K]`` by TMA (out-of-range rows and columns read as 0);
    ``W`` itself (the pointer) for ``USE_PDL``'s prefetch of the tile's weight rows (``_weights_then_wait``)."""
    m0 = tl.program_id(0) * BM
    j = tl.program_id(1)
    _weights_then_wait(W, j * BN, tl.minimum(N - j * BN, BN), K, USE_PDL)
    m = m0 + tl.arange(0, BM)
    n = j * BN + tl.arange(0, BN)
    rows = m.to(tl.int64)[:, None]
    mask = (m < M)[:, None] & (n < N)[None, :]
    # the residual tile is loaded before the K loop and used after it: its latency hides under the loop (loaded after
    # the loop, the epilogue waited for it); nothing before the loop uses it, so the TMA loads are not held back
    res = tl.load(RES + rows * stride_res + n[None, :], mask=mask, other=0.0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc = tl.dot(a_desc.load([m0, k0]), w_desc.load([j * BN, k0]).T, acc, input_precision=PREC)
    DT: tl.constexpr = H.dtype.element_ty
    h = cast_rn(cast_rn(acc, DT).to(tl.float32) + res.to(tl.float32), DT)
    tl.store(H + rows * stride_h + n[None, :], h, mask=mask)
    hf = h.to(tl.float32)  # 0 outside the tile's live rows and columns: W's and RES's masked values are 0
    tl.store(SS + m.to(tl.int64) * stride_ss + j, tl.sum(hf * hf, 1), mask=m < M)


@triton.jit
def _row_rsqrt(SS, m, live, stride_ss, P, K, eps, BP: tl.constexpr):
    """``[BM, 1]`` fp32 ``rsqrt(mean(h^2) + eps)`` of rows ``m`` (K columns) from SS's P partials (fixed order).
    Called before the K loop, where it holds back the first tiles' TMA loads by one load's latency (Triton's
    pipeliner issues them just before the loop, after this reduction: sm90 TTGIR). Inside the loop (``if k0 ==
    0``) it would not, but the loop-carried ``r`` cost registers (sm90: gate_up 121 -> 200, 3 -> 2 programs an
    SM; qkv 168 -> 239) and a second shared-memory read of each h tile, so it stays here until a GPU says
    otherwise (in the loop without the ``if``, the compiler hoists it back out)."""
    p = tl.arange(0, BP)
    parts = tl.load(SS + m.to(tl.int64)[:, None] * stride_ss + p[None, :], mask=live & (p < P)[None, :], other=0.0)
    return rsqrt_f32(tl.sum(parts, 1) / K + eps)[:, None]


@triton.jit
def _norm_weights(NW, k0, K, BK: tl.constexpr):
    """``[BK]``: the RMSNorm weight's columns ``k0 ...`` (0 past K), as stored. The K loops load the next tile's
    while this tile's run: a 256-byte vector, too narrow for Triton 3.6's pipeliner (sm90 TTGIR: a plain load in
    the loop, its latency in every iteration before the dots), so the loops carry it one tile ahead themselves (and
    convert it in ``_normed_tile``: a conversion here would wait for the load where it is issued)."""
    k = k0 + tl.arange(0, BK)
    return tl.load(NW + k, mask=k < K, other=0.0)


@triton.jit
def _normed_tile(h_desc, w, m0, k0, r, DT: tl.constexpr):
    """The ``[BM, BK]`` tile (rows ``m0 ...``, columns ``k0 ...``) of ``rmsnorm(H)`` in DT, as ``triton_norm``
    rounds: ``round(round(h * r) * w)``, ``w`` the tile's norm weights (``_norm_weights``). H's tile by TMA (rows
    past the end read as 0)."""
    h = h_desc.load([m0, k0]).to(tl.float32)
    return cast_rn(cast_rn(h * r, DT).to(tl.float32) * w.to(tl.float32)[None, :], DT)


@triton.jit
def _norm_linear_kernel(h_desc, SS, NW, w_desc, W, B, C, M, N, K, P, eps, stride_ss, stride_c, INTER,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                        SWIGLU: tl.constexpr, BIAS: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr = False,
                        FOLDED: tl.constexpr = False):
    """Program (row tile, column tile): ``C = rmsnorm(H) @ W^T`` on its tile, the row's ``rsqrt(mean(h^2) + eps)``
    from ``SS``'s P partials, the normed rows built in registers tile by tile of K; H's and W's tiles by TMA (so
    Triton's pipeliner prefetches both; H's pointer loads were not). SWIGLU: W is gate_up ``[2 INTER, K]``; the
    program also multiplies the up rows ``INTER + n`` and writes SwiGLU's product to C ``[M, INTER]``. BIAS (not
    with SWIGLU): ``B [N]`` added to the fp32 product before its rounding, as cuBLAS's bias epilogue adds it.
    ``W``: the weight's pointer, for ``USE_PDL``'s prefetch (gate and up rows). FOLDED: W is ``fold_norm``'s
    ``W diag(norm weight)`` (NW unused): H's raw tiles go to the dots as TMA loads them and the row scale ``r``
    multiplies the fp32 product after the loop (``r * (H @ W'^T)``, then the bias and the rounding)."""
    m0 = tl.program_id(0) * BM
    m = m0 + tl.arange(0, BM)
    n0 = tl.program_id(1) * BN
    if SWIGLU and USE_PDL:
        _prefetch_first_row_tile(W, INTER + n0, tl.minimum(N - n0, BN), K)  # the up rows; the gate rows below
    _weights_then_wait(W, n0, tl.minimum(N - n0, BN), K, USE_PDL)
    n = n0 + tl.arange(0, BN)
    live = (m < M)[:, None]
    DT: tl.constexpr = C.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    if FOLDED:  # a plain TMA GEMM; nothing before the loop holds back its first loads
        for k0 in range(0, K, BK):
            a = h_desc.load([m0, k0])
            acc = tl.dot(a, w_desc.load([n0, k0]).T, acc, input_precision=PREC)
            if SWIGLU:
                acc_up = tl.dot(a, w_desc.load([INTER + n0, k0]).T, acc_up, input_precision=PREC)
        r = _row_rsqrt(SS, m, live, stride_ss, P, K, eps, BP)
        acc = acc * r
        if SWIGLU:
            acc_up = acc_up * r
    else:
        r = _row_rsqrt(SS, m, live, stride_ss, P, K, eps, BP)
        nw = _norm_weights(NW, 0, K, BK)
        for k0 in range(0, K, BK):
            nw_next = _norm_weights(NW, k0 + BK, K, BK)
            a = _normed_tile(h_desc, nw, m0, k0, r, DT)
            acc = tl.dot(a, w_desc.load([n0, k0]).T, acc, input_precision=PREC)
            if SWIGLU:
                acc_up = tl.dot(a, w_desc.load([INTER + n0, k0]).T, acc_up, input_precision=PREC)
            nw = nw_next
    if BIAS:
        acc += tl.load(B + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = cast_rn(acc, DT)
    if SWIGLU:
        out = swiglu_rn(out.to(tl.float32), cast_rn(acc_up, DT).to(tl.float32), DT)
    tl.store(C + m.to(tl.int64)[:, None] * stride_c + n[None, :], out, mask=live & (n < N)[None, :])


@triton.jit
def _norm_qkv_cache_kernel(h_desc, SS, NW, w_desc, W, B, POS, COS, SIN, QW, KW, Q, KC, VC, SLOT, M, K, P, eps,
                           head_eps, stride_ss, stride_qt, stride_qh, stride_rope, stride_cs, stride_ch,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, NORM: tl.constexpr,
                           BIAS: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, PREC: tl.constexpr,
                           USE_PDL: tl.constexpr = False, FOLDED: tl.constexpr = False):
    """Program (row tile, head j): head j's D columns of ``rmsnorm(H) @ W_qkv^T`` as its two halves (two dots of
    HALF columns: rotate-half RoPE pairs column i with i + HALF, so each pair sits at one place of the two
    accumulators), then ``triton_qkv._qkv_cache_kernel``'s work on them: j < H a q head (q/k norm, RoPE, to Q
    ``[M, H, D]``), j < H + HKV a k head (norm, RoPE, into KC at SLOT), else a v head (into VC). BIAS: the qkv
    bias ``B`` (Qwen2) added before the GEMM output's rounding. ``W``: the weight's pointer, for ``USE_PDL``'s
    prefetch of the head's D rows. FOLDED: W is ``fold_norm``'s ``W diag(norm weight)``, as in
    ``_norm_linear_kernel``."""
    m0 = tl.program_id(0) * BM
    j = tl.program_id(1)
    _weights_then_wait(W, j * D, D, K, USE_PDL)
    m = m0 + tl.arange(0, BM)
    tmask = m < M
    # the epilogue's positions are loaded before the K loop and used after it: their latency hides under the loop,
    # so after it the RoPE tables' gather (and, beside it, the slots' load) waits one load, not two in a chain.
    # Nothing before the loop uses them: the first tiles' TMA loads are not held back (sm90: 175 -> 236 registers
    # on 8 warps, no spills; one program an SM either way, by its shared memory)
    pos = tl.load(POS + m, mask=tmask, other=0)
    DT: tl.constexpr = Q.dtype.element_ty
    acc1 = tl.zeros([BM, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BM, HALF], dtype=tl.float32)
    if FOLDED:
        for k0 in range(0, K, BK):
            a = h_desc.load([m0, k0])
            acc1 = tl.dot(a, w_desc.load([j * D, k0]).T, acc1, input_precision=PREC)
            acc2 = tl.dot(a, w_desc.load([j * D + HALF, k0]).T, acc2, input_precision=PREC)
        r = _row_rsqrt(SS, m, tmask[:, None], stride_ss, P, K, eps, BP)
        acc1 = acc1 * r
        acc2 = acc2 * r
    else:
        r = _row_rsqrt(SS, m, tmask[:, None], stride_ss, P, K, eps, BP)
        nw = _norm_weights(NW, 0, K, BK)
        for k0 in range(0, K, BK):
            nw_next = _norm_weights(NW, k0 + BK, K, BK)
            a = _normed_tile(h_desc, nw, m0, k0, r, DT)
            acc1 = tl.dot(a, w_desc.load([j * D, k0]).T, acc1, input_precision=PREC)
            acc2 = tl.dot(a, w_desc.load([j * D + HALF, k0]).T, acc2, input_precision=PREC)
            nw = nw_next
    i = tl.arange(0, HALF)
    col = i[None, :]
    mask = tmask[:, None] & (i < HALF)[None, :]
    if BIAS:
        acc1 += tl.load(B + j * D + i).to(tl.float32)[None, :]
        acc2 += tl.load(B + j * D + HALF + i).to(tl.float32)[None, :]
    x1, x2 = cast_rn(acc1, DT), cast_rn(acc2, DT)  # the qkv GEMM's output, rounded as torch's linear rounds it
    slot = tl.load(SLOT + m, mask=tmask, other=0)
    if j < H + HKV:
        o1, o2 = _norm_rope_head(x1.to(tl.float32), x2.to(tl.float32), j, pos, i, i < HALF, col, mask, COS, SIN, QW,
                                 KW, head_eps, stride_rope, H, D, HALF, NORM, DT)
        if j < H:
            out = Q + m.to(tl.int64)[:, None] * stride_qt + j * stride_qh + col
            tl.store(out, o1, mask=mask)
            tl.store(out + HALF, o2, mask=mask)
        else:
            _store_halves(KC, _cache_slots(slot, j - H, col, stride_cs, stride_ch), o1, o2, mask, HALF, FP8, FP8_MAX)
    else:
        _store_halves(VC, _cache_slots(slot, j - H - HKV, col, stride_cs, stride_ch), x1, x2, mask, HALF, FP8, FP8_MAX)


def _k_tile(K: int, preferred: int) -> Optional[int]:
    """The largest power-of-two K tile <= ``preferred`` (and >= 16, ``tl.dot``'s least) that divides K."""
    bk = preferred
    while bk >= 16 and K % bk:
        bk //= 2
    return bk if bk >= 16 else None


def launch(kind: str, K: int, N: int) -> Optional[tuple[int, int, int, int, int]]:
    """(BM, BN, BK, warps, stages) of ``kind`` (a ``LAUNCH`` key) for K -> N, or None where no K tile
    divides K. The column tile shrinks to N's largest power of two below it (a small model's few columns)."""
    bm, bn, bk, warps, stages = LAUNCH[kind]
    bk = _k_tile(K, bk)
    if bk is None or N < 16:
        return None
    return bm, min(bn, 1 << (N.bit_length() - 1)), bk, warps, stages


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton's host descriptors: only where it runs

    return TensorDescriptor.from_tensor(t, block)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is Triton's default and means nothing to bf16 / fp16


def _pdl_options(weight: torch.Tensor) -> dict:
    """``pdl.launch_options`` for a kernel multiplying ``weight``: its prefetch takes a program's weight rows as one
    contiguous range, so a weight that is a strided view launches plainly."""
    return launch_options(weight.device) if weight.is_contiguous() else {"USE_PDL": False}


def tma_ready(t: torch.Tensor) -> bool:
    """Whether ``t`` (2-D) can back a TMA descriptor: contiguous columns, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    config: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x @ weight^T`` (the GEMM's output rounded to the model dtype first) and ``ss [T, P]`` fp32,
    the row sums of ``h^2`` in ``P`` column-tile partials. ``x [T, K]``, ``weight [N, K]`` TMA-ready (``tma_ready``),
    ``residual [T, N]`` with contiguous columns. ``config``: (BM, BN, BK, warps, stages), default
    ``launch("residual", K, N)``."""
    (T, K), N = x.shape, weight.shape[0]
    bm, bn, bk, warps, stages = config or launch("residual", K, N)
    x = x if tma_ready(x) else x.clone(memory_format=torch.contiguous_format)  # a view off 16-byte alignment
    h = torch.empty(T, N, dtype=x.dtype, device=x.device)
    ss = torch.empty(T, triton.cdiv(N, bn), dtype=torch.float32, device=x.device)
    if T:
        _linear_residual_kernel[(triton.cdiv(T, bm), ss.shape[1])](
            _descriptor(x, [bm, bk]), _descriptor(weight, [bn, bk]), weight, residual, h, ss, T, N, K,
            residual.stride(0), h.stride(0), ss.stride(0), BM=bm, BN=bn, BK=bk, PREC=_precision(x.dtype),
            num_warps=warps, num_stages=stages, **_pdl_options(weight))
    return h, ss


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``W' = W diag(w)``, ``weight [N, K]`` times the RMSNorm weight ``w [K]`` per column, in fp32, rounded once to
    W's dtype (into ``out`` in place where given: a CUDA graph's captured address keeps its meaning after a weight
    sync). ``rmsnorm(h) @ W^T = r * (h @ W'^T)`` with ``r = rsqrt(mean(h^2) + eps)`` per row: the norm leaves the
    GEMM's prologue (``norm_linear(..., folded=True)``)."""
    folded = weight.float() * norm_weight.float()[None, :]
    if out is None:
        return folded.to(weight.dtype)
    return out.copy_(folded)


def _norm_kind(kind: str, folded: bool) -> str:
    """The ``LAUNCH`` key of a norm-prologue kind ("norm", "swiglu", "qkv_cache") or of its folded form."""
    if not folded:
        return kind
    return "folded" if kind == "norm" else f"folded_{kind}"


def norm_linear(h: torch.Tensor, ss: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                eps: float, inter: Optional[int] = None, bias: Optional[torch.Tensor] = None,
                config: Optional[tuple] = None, folded: bool = False) -> torch.Tensor:
    """``rmsnorm(h) @ weight^T (+ bias)`` with ``mean(h^2)`` from ``ss [T, P]`` (``linear_residual``'s partials, or
    any split of the row sums); with ``inter``: SwiGLU of a gate_up ``weight [2 inter, K]`` -> ``[T, inter]`` (no
    bias). ``h [T, K]`` and ``weight [N, K]`` TMA-ready, ``norm_weight [K]`` and ``bias [N]`` in h's dtype.
    ``folded``: ``weight`` is ``fold_norm(W, norm_weight)`` (``norm_weight`` unused, may be None) and the kernel a
    plain GEMM with the row scale in its epilogue: not the engine's roundings (the normed rows are not rounded to the
    model dtype before the product; W' is rounded once), a different rounding of the same product.
    ``config``: (BM, BN, BK, warps, stages), default ``launch`` of the kind ("norm" / "swiglu", "folded" /
    "folded_swiglu")."""
    if inter is not None and bias is not None:
        raise ValueError("norm_linear: a SwiGLU projection with a bias is not supported")
    (T, K), N = h.shape, inter or weight.shape[0]
    bm, bn, bk, warps, stages = config or launch(_norm_kind("swiglu" if inter else "norm", folded), K, N)
    out = torch.empty(T, N, dtype=h.dtype, device=h.device)
    if T:
        P = ss.shape[1]
        nw = weight if folded else norm_weight  # folded: NW is never read
        _norm_linear_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
            _descriptor(h, [bm, bk]), ss, nw, _descriptor(weight, [bn, bk]), weight, nw if bias is None else bias,
            out, T, N, K, P, eps, ss.stride(0), out.stride(0), inter or 0, BM=bm, BN=bn, BK=bk,
            BP=triton.next_power_of_2(P), SWIGLU=inter is not None, BIAS=bias is not None, PREC=_precision(h.dtype),
            FOLDED=folded, num_warps=warps, num_stages=stages, **_pdl_options(weight))
    return out


def qkv_epilogue_fits(head_dim: int) -> bool:
    """Whether ``norm_qkv_to_cache`` takes heads of ``head_dim``: each half a power of two ``tl.dot`` can make."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def norm_qkv_to_cache(h: torch.Tensor, ss: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float,
                      positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm_w: Optional[torch.Tensor],
                      k_norm_w: Optional[torch.Tensor], head_eps: float, num_heads: int, num_kv_heads: int,
                      head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                      folded: bool = False) -> torch.Tensor:
    """``triton_qkv.qkv_to_cache(norm_linear(h, ss, norm_weight, weight, eps), ...)`` in one kernel: the layer's
    RMSNorm in the qkv GEMM's prologue, the q/k norm + RoPE + K/V cache write in its epilogue -> q ``[T, H, D]``;
    k and v land in the caches at ``slot_mapping``. ``bias``: the qkv bias (Qwen2) or None. ``h`` and ``weight [(H
    + 2 Hkv) D, K]`` TMA-ready, heads as ``qkv_epilogue_fits`` says, the rest as ``qkv_to_cache`` takes them.
    ``folded``: ``weight`` is ``fold_norm(W_qkv, norm_weight)``, as in ``norm_linear``. ``config``: (BM, -, BK,
    warps, stages), default ``launch("qkv_cache" / "folded_qkv_cache", K, N)`` (the column tile is the head)."""
    (T, K), D = h.shape, head_dim
    if not qkv_epilogue_fits(D) or weight.shape[0] != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"norm_qkv_to_cache: weight {tuple(weight.shape)} is not [(H + 2 Hkv) * D, K] with D / 2 a "
                         f"power of two >= 16 (H={num_heads}, Hkv={num_kv_heads}, D={D})")
    check_tables("norm_qkv_to_cache", h.dtype, D, cos, sin, k_cache, v_cache)
    q = torch.empty(T, num_heads, D, dtype=h.dtype, device=h.device)
    if T == 0:
        return q
    bm, _, bk, warps, stages = config or launch(_norm_kind("qkv_cache", folded), K, weight.shape[0])
    norm = q_norm_w is not None
    P, half = ss.shape[1], D // 2
    nw = weight if folded else norm_weight  # folded: NW is never read
    _norm_qkv_cache_kernel[(triton.cdiv(T, bm), num_heads + 2 * num_kv_heads)](
        _descriptor(h, [bm, bk]), ss, nw, _descriptor(weight, [half, bk]), weight, nw if bias is None else bias,
        positions, cos, sin, q_norm_w if norm else cos,
        k_norm_w if norm else cos, q, k_cache, v_cache, slot_mapping, T, K, P, eps, head_eps, ss.stride(0),
        q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2), H=num_heads,
        HKV=num_kv_heads, D=D, HALF=half, BM=bm, BK=bk, BP=triton.next_power_of_2(P), NORM=norm,
        BIAS=bias is not None, FP8=k_cache.dtype == FP8_KV, FP8_MAX=FP8_KV_MAX, PREC=_precision(h.dtype),
        FOLDED=folded, num_warps=warps, num_stages=stages, **_pdl_options(weight))
    return q


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """``[T, 1]`` fp32 row sums of ``x^2``: the ``ss`` of a hidden state no GEMM wrote (the embedding's, which
    feeds the first layer's norm)."""
    xf = x.float()
    return (xf * xf).sum(-1, keepdim=True)
