"""The LM head's GEMM with the one-pass sampler in its epilogue: hidden states in, tokens and log-probs out, the
``[B, V]`` logits never written. Opt-in (``model_runner.FUSED_LM_HEAD_SAMPLER``, off): timed on an H200 (2026-12-05,
``bench/lm_head_sampler.py``, 256 rows, the 0.6B head) it takes 409-443 us where cuBLAS's head + the one-pass sampler
take 285-287 (0.65-0.70x), tokens equal.

Why: at workload (a)'s decode steps the LM head (``F.linear`` of 256 rows by Qwen3's 151,936-row vocabulary, 311 MB
of bf16 weights) took 0.116 ms and ``triton_sampler.sample_unfiltered`` 0.151 ms more, reading back the 78 MB of
logits the GEMM had just written and spending most of its time on the noise and the exponentials
(bench/RESULTS.md, session 48). Here each GEMM program turns its ``[BM, BN]`` logits tile into per-row partials
of the sampler's reductions while other programs stream weights, and ``_combine_kernel`` merges a row's tiles.

Numbers: ``sample_unfiltered``'s, from the same logits. A tile's logits are the GEMM's fp32 accumulator rounded to
the model dtype, as ``F.linear`` returns them (the K order of the sum may differ from cuBLAS's: a logit may sit one
rounding step away); then ``s = x / T`` (IEEE division, skipped when every row of the tile has T = 1: ``x / 1 ==
x``), the race ``s + g`` with ``triton_sampler._gumbel``'s bit-identical noise, greedy rows (``T <= 0``) the first
argmax of ``x``, ties to the first index in tiles and across them. The log-prob is ``(s_tok - max) - log(sum exp(s
- max))``, where the sum runs tile by tile (an fp32 ulp or two from the one-pass kernel's order).

Partials, per (row, vocab tile): PART ``[4, B, S]`` fp32 = (max of s, sum exp(s - max), best race value, s at the
race's argmax), IPART ``[2, B, S]`` int32 = (first argmax of s, first race argmax); S = the vocab tiles.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from asyncrl.engine.sampler import U_MAX
from asyncrl.engine.triton_gemm import _descriptor, _k_tile, _precision, tma_ready
from asyncrl.engine.triton_decode import num_sms
from asyncrl.engine.triton_qkv import cast_rn
from asyncrl.engine.triton_sampler import _gumbel, _log, merge_splits

# (BM, BN, BK, warps, stages, programs per SM; 0: one program per vocab tile). A first guess: 128 registers a thread
# on 8 warps (no spills, 148 KB of shared memory on sm90 offline) fit one program an SM, so one persistent program
# per SM walks its vocab tiles in one flattened, pipelined loop (the next tile's loads in flight during this tile's
# epilogue); bench/lm_head_sampler.py sweeps it on a GPU.
LAUNCH = (64, 128, 128, 8, 3, 1)


@triton.jit
def _lm_head_partial_kernel(h_desc, w_desc, TEMP, KEYS, PART, IPART, M, V, K, n_tiles,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, U_HI: tl.constexpr,
                            PREC: tl.constexpr):
    """Program (row tile, p) over vocab tiles ``j = p, p + P, ...`` (P programs along the vocabulary): each tile's
    ``[BM, BN]`` logits ``H @ W^T`` (both by TMA), then each row's partials of the tile (module docstring) at
    ``PART[:, row, j]``, ``IPART[:, row, j]``. The tile and K loops are flattened into one for the pipeliner, so
    the next tile's first loads are in flight while this tile's epilogue runs."""
    m0 = tl.program_id(0) * BM
    m = m0 + tl.arange(0, BM)
    live = m < M
    t = tl.load(TEMP + m, mask=live, other=1.0)
    t = tl.where(t <= 0, 1.0, t)  # greedy rows: their argmax and log-prob at T = 1
    unit = tl.max(tl.abs(t - 1.0), 0) == 0.0  # every row at T = 1 (the RL default): x / 1 == x, no divisions
    key = (tl.load(KEYS + m, mask=live, other=0) & 0xFFFFFFFF).to(tl.uint32)
    rows = m.to(tl.int64) * n_tiles
    plane = M * n_tiles
    for j in tl.range(tl.program_id(1), n_tiles, tl.num_programs(1), flatten=True):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc = tl.dot(h_desc.load([m0, k0]), w_desc.load([j * BN, k0]).T, acc, input_precision=PREC)
        ms, ls, rv, rs, gs, ri = _tile_partials(cast_rn(acc, h_desc.dtype).to(tl.float32), j * BN, V, t, unit, key,
                                                BM, BN, U_HI)
        o = rows + j
        tl.store(PART + o, ms, mask=live)
        tl.store(PART + plane + o, ls, mask=live)
        tl.store(PART + 2 * plane + o, rv, mask=live)
        tl.store(PART + 3 * plane + o, rs, mask=live)
        tl.store(IPART + o, gs, mask=live)
        tl.store(IPART + plane + o, ri, mask=live)


@triton.jit
def _tile_partials(x, n0, V, t, unit, key, BM: tl.constexpr, BN: tl.constexpr, U_HI: tl.constexpr):
    """The sampler's reductions over one logits tile ``x [BM, BN]`` (fp32 values of the model dtype, columns ``n0
    ...``): per row (max of s, sum exp(s - max), best race value, s there, first argmax of s, first race argmax)."""
    idx = n0 + tl.arange(0, BN)
    neg_inf = float("-inf")
    if unit:
        s = x
    else:
        s = tl.math.div_rn(x, tl.zeros([BM, BN], tl.float32) + t[:, None])  # IEEE division, as torch's logits / t
    s = tl.where((idx < V)[None, :], s, neg_inf)
    r = s + _gumbel(key[:, None], idx[None, :].to(tl.uint32), U_HI)
    big = 2147483647
    ms = tl.max(s, 1)
    gs = tl.min(tl.where(s == ms[:, None], idx[None, :], big), 1)
    ls = tl.sum(tl.exp(s - ms[:, None]), 1)  # a tile has a live column: ms is finite
    rv = tl.max(r, 1)
    ri = tl.min(tl.where(r == rv[:, None], idx[None, :], big), 1)
    rs = tl.max(tl.where(idx[None, :] == ri[:, None], s, neg_inf), 1)
    return ms, ls, rv, rs, gs, ri


@triton.jit
def _combine_kernel(TEMP, PART, IPART, TOK, LOGP, n_tiles, MAX_TILES: tl.constexpr):
    """Program per row: merge its vocab tiles' partials in vocab order (the first maximum wins), pick the token
    (greedy rows: the first argmax of x) and write TOK ``[B]`` int64, LOGP ``[B]`` fp32."""
    row = tl.program_id(0)
    i = tl.arange(0, MAX_TILES)
    ok = i < n_tiles
    plane = tl.num_programs(0) * n_tiles
    o = row.to(tl.int64) * n_tiles + i
    neg_inf = float("-inf")
    big = 2147483647
    m = tl.load(PART + o, mask=ok, other=neg_inf)
    l = tl.load(PART + plane + o, mask=ok, other=0.0)
    rv = tl.load(PART + 2 * plane + o, mask=ok, other=neg_inf)
    rs = tl.load(PART + 3 * plane + o, mask=ok, other=neg_inf)
    gi = tl.load(IPART + o, mask=ok, other=big)
    ri = tl.load(IPART + plane + o, mask=ok, other=big)
    mx, total, g_tok, r_best, r_tok = merge_splits(m, l, rv, gi, ri)
    s_race = tl.max(tl.where((rv == r_best) & (ri == r_tok), rs, neg_inf), 0)
    greedy = tl.load(TEMP + row) <= 0
    tok = tl.where(greedy, g_tok, r_tok)
    s_tok = tl.where(greedy, mx, s_race)  # a greedy row's token is its max of s
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LOGP + row, (s_tok - mx) - _log(total))  # torch's log_softmax association


def fits(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``lm_head_sample`` takes ``hidden [B, K]`` and the head ``weight [V, K]``: one dtype, both
    TMA-ready, a K tile that divides K."""
    return (hidden.dtype == weight.dtype and hidden.dim() == 2 and weight.dim() == 2
            and hidden.shape[1] == weight.shape[1] and tma_ready(hidden) and tma_ready(weight)
            and _k_tile(weight.shape[1], LAUNCH[2]) is not None)


def lm_head_sample(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                   config: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_sampler.sample_unfiltered(F.linear(hidden, weight), temperature, keys)`` without the logits:
    hidden ``[B, K]``, weight ``[V, K]`` (as ``fits`` says), temperature ``[B]`` fp32 (<= 0: greedy), keys ``[B]``
    int64 -> (tokens ``[B]`` int64, log-probs ``[B]`` fp32). ``config``: (BM, BN, BK, warps, stages, programs per
    SM, 0 = one per vocab tile), default ``LAUNCH`` (BK shrunk to divide K). Fixed shapes per B, no host sync:
    CUDA-graph safe."""
    (B, K), V = hidden.shape, weight.shape[0]
    bm, bn, bk, warps, stages, per_sm = config or LAUNCH
    bk = _k_tile(K, bk)
    tokens = torch.empty(B, dtype=torch.int64, device=hidden.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=hidden.device)
    if B == 0:
        return tokens, logprobs
    n_tiles = triton.cdiv(V, bn)
    part = torch.empty(4, B, n_tiles, dtype=torch.float32, device=hidden.device)
    ipart = torch.empty(2, B, n_tiles, dtype=torch.int32, device=hidden.device)
    temperature = temperature.to(torch.float32).contiguous()
    keys = keys.contiguous()
    row_tiles = triton.cdiv(B, bm)
    along = triton.cdiv(per_sm * num_sms(hidden.device), row_tiles) if per_sm else n_tiles
    _lm_head_partial_kernel[(row_tiles, min(along, n_tiles))](
        _descriptor(hidden, [bm, bk]), _descriptor(weight, [bn, bk]), temperature, keys, part, ipart, B, V, K,
        n_tiles, BM=bm, BN=bn, BK=bk, U_HI=U_MAX, PREC=_precision(hidden.dtype), num_warps=warps,
        num_stages=stages)
    _combine_kernel[(B,)](temperature, part, ipart, tokens, logprobs, n_tiles,
                          MAX_TILES=triton.next_power_of_2(n_tiles), num_warps=4)
    return tokens, logprobs
