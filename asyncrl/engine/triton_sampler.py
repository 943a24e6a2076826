"""Triton sampler for rows without top-k / top-p: one pass over each row's logits.

``sample_unfiltered(logits, temperature, keys)`` returns what ``sampler.sample`` returns
with ``use_filter=False``: the Gumbel-race token ``argmax(x/T + g)`` (``= argmax(logp + g)``:
the row's logsumexp is a constant), greedy rows (``T <= 0``) the first ``argmax(x)``, and
the chosen token's log-prob ``x_tok/T - logsumexp(x/T)`` (greedy rows: at ``T = 1``).
The compiled torch sampler spends ~380 us at batch 256 x 151,936 vocab on an H200 in three
kernels; this reads the logits once.

Noise: ``_gumbel`` is ``sampler.gumbel_noise`` in uint32 arithmetic. The torch version
works on int64 but masks every product to 32 bits (``& _M32``) before using it, so
wrapping uint32 multiplies give the same bits; ``x / T`` uses IEEE division (``div_rn``)
and ``log`` is libdevice's ``logf`` (what torch's CUDA ``log`` calls), so the noise and the
scaled logits are bit-identical to torch's.

Grid (two launches, fixed shapes for a given batch, no host sync: CUDA-graph safe):
``_partial_kernel`` runs (row, split) programs, each walking a contiguous range of
``BLOCK``-wide vocab tiles with per-lane fp32 state (online max / sum-exp / greedy index /
race value / race index), loading the next tile while it computes one, then reduces its
lanes into one partial per (row, split): no block-wide reduction inside the loop. Greedy
rows skip the noise. Until 2026-12-04 a tile also skipped its noise when its largest ``x/T``
plus the noise's bound could not beat the program's best race value so far; that test's
per-tile max cost more than it saved, even on LM-like peaked rows where it skipped most
tiles: without it and with the next tile's load in flight, 1.40-1.55x at batches 64-512
(H200, fp32 logits, 151,936 vocab; 256 rows: 0.219 -> 0.150 ms), end to end 1.018x on
workload (a) and 1.005x on (c) (``bench/sampler_kernel.py``, ``bench/RESULTS.md`` session
47). ``_combine_kernel`` merges a row's splits and gathers ``x_tok`` for the log-prob.
Small batches get more splits per row so that enough programs are in flight (batch 1: one
tile per program).

Ties: lanes and splits keep the FIRST index of their maximum, so greedy rows match
``torch.argmax`` exactly, ties included. The race value is ``x/T + g`` where torch
compares ``((x/T - max) - log(sum)) + g``: the extra fp32 roundings in torch can flip a
race whose top two values are within a few ulps (~1e-6 relative; by our estimate about
one row in 10^5 on random logits; ``race_values`` tells such a near tie in checks).
NaN logits are ignored here (torch's argmax would pick them); ``+inf`` logits are not
supported.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from asyncrl.engine.sampler import U_MAX, gumbel_noise
from asyncrl.engine.triton_decode import num_sms

# The interpreter (TRITON_INTERPRET=1, CPU tests) has no libdevice: numpy's log there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:
    @triton.jit
    def _log(x):
        return tl.log(x)
else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _log(x):
        return libdevice.log(x)  # logf: the same bits as torch's CUDA log


@triton.jit
def _mix32(x):
    """sampler._mix32 on uint32 (its ``& _M32`` masks are the uint32 wraparound)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel(key, v, U_HI: tl.constexpr):
    """key: uint32 scalar, v: uint32 vocab indices ``[BLOCK]`` -> fp32 noise ``[BLOCK]``,
    bit-identical to ``gumbel_noise``."""
    x = _mix32(key * 0x9E3779B1 + v)
    x = _mix32(x ^ (key >> 7))
    u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    u = tl.minimum(u, U_HI)  # (2^24 - 1) + 0.5 rounds to 2^24 in fp32: u == 1 -> g == +inf
    return -_log(-_log(u))


@triton.jit
def _noise_kernel(KEYS, G, V, BLOCK: tl.constexpr, U_HI: tl.constexpr):
    """Test hook: ``G [B, V]`` = the kernel's noise (compared bitwise with gumbel_noise)."""
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = (tl.load(KEYS + row) & 0xFFFFFFFF).to(tl.uint32)
    g = _gumbel(key, idx.to(tl.uint32), U_HI)
    tl.store(G + row.to(tl.int64) * V + idx, g, mask=idx < V)


@triton.jit
def merge_splits(m, l, rv, gi, ri):
    """A row's partials ``[S]`` (lanes, splits or vocab tiles in vocab order: max of s, sum exp(s - max), best race
    value, first argmax of s, first race argmax; padding entries -inf / 0 / -inf / big / big) merged, the first
    maximum winning:
    (max of s, sum exp(s - max), first argmax of s, best race value, first race argmax)."""
    neg_inf = float("-inf")
    big = 2147483647
    mx = tl.max(m, 0)
    total = tl.sum(l * tl.exp(m - tl.where(mx == neg_inf, 0.0, mx)), 0)  # l == 0 where m == -inf
    g_tok = tl.min(tl.where(m == mx, gi, big), 0)
    r_best = tl.max(rv, 0)
    r_tok = tl.min(tl.where(rv == r_best, ri, big), 0)
    return mx, total, g_tok, r_best, r_tok


@triton.jit(do_not_specialize=["n_splits"])
def _partial_kernel(X, stride_x, V, TEMP, KEYS, PART, IPART, n_splits, n_tiles,
                    BLOCK: tl.constexpr, U_HI: tl.constexpr):
    """Program (row, split) over tiles ``[split*n_tiles//n_splits, (split+1)*n_tiles//n_splits)``.
    Writes PART ``[3, B, n_splits]`` fp32 = (max of x/T, sum exp(x/T - max), best race
    value) and IPART ``[2, B, n_splits]`` int32 = (first argmax of x/T, first race argmax)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(TEMP + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    key = (tl.load(KEYS + row) & 0xFFFFFFFF).to(tl.uint32)
    x_row = X + row.to(tl.int64) * stride_x
    t0 = split * n_tiles // n_splits
    t1 = (split + 1) * n_tiles // n_splits
    lane = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, tl.float32)   # lane max of s = x/T
    l = tl.zeros([BLOCK], tl.float32)           # lane sum of exp(s - m)
    gi = t0 * BLOCK + lane                      # lane first argmax of s (all -inf: first index)
    t_vec = tl.zeros([BLOCK], tl.float32) + t   # explicit broadcast for div_rn
    rv = tl.full([BLOCK], neg_inf, tl.float32)  # lane best race value s + g
    ri = gi
    x_next = tl.load(x_row + gi, mask=gi < V, other=neg_inf)  # tile t0
    for tile in range(t0, t1):
        idx = tile * BLOCK + lane
        x = x_next.to(tl.float32)
        # the next tile's load is in flight while this one is computed
        nxt = idx + BLOCK
        x_next = tl.load(x_row + nxt, mask=(nxt < V) & (tile + 1 < t1), other=neg_inf)
        # row-uniform branches: T == 1 (the RL default) skips the division, greedy rows
        # skip the noise (their race is never read). No tile skips its noise: a per-tile test
        # needs a block-wide max (a barrier a tile), which cost more than the noise it saved
        # even on LM-like peaked rows (see the module docstring)
        if t == 1.0:
            s = x
        else:
            s = tl.math.div_rn(x, t_vec)  # IEEE division, as torch's logits / t
        if greedy:
            r = s
        else:
            r = s + _gumbel(key, idx.to(tl.uint32), U_HI)
        # online sum-exp with one exp per element: exp(-|s - m|) serves both cases
        up = s > m
        hi = tl.where(up, s, m)
        lo = tl.where(up, m, s)
        e = tl.exp(lo - tl.where(hi == neg_inf, 0.0, hi))  # both -inf: exp(-inf) = 0
        l = tl.where(up, l * e + 1.0, l + e)
        gi = tl.where(up, idx, gi)
        m = hi
        win = r > rv  # strict: a lane keeps its first maximum
        rv = tl.where(win, r, rv)
        ri = tl.where(win, idx, ri)
    mp, lp, gp, rp, rip = merge_splits(m, l, rv, gi, ri)  # the lanes, as the combine merges the splits
    n = tl.num_programs(0) * n_splits  # B * n_splits: one plane of PART
    o = row * n_splits + split
    tl.store(PART + o, mp)
    tl.store(PART + n + o, lp)
    tl.store(PART + 2 * n + o, rp)
    tl.store(IPART + o, gp)
    tl.store(IPART + n + o, rip)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(X, stride_x, TEMP, PART, IPART, TOK, LOGP, n_splits, MAX_SPLITS: tl.constexpr):
    """Program per row: merge its splits (in vocab order: the first maximum wins), pick the
    token (greedy rows: argmax x) and write TOK ``[B]`` int64, LOGP ``[B]`` fp32."""
    row = tl.program_id(0)
    i = tl.arange(0, MAX_SPLITS)
    ok = i < n_splits
    n = tl.num_programs(0) * n_splits
    o = row * n_splits + i
    neg_inf = float("-inf")
    big = 2147483647
    m = tl.load(PART + o, mask=ok, other=neg_inf)
    l = tl.load(PART + n + o, mask=ok, other=0.0)
    rv = tl.load(PART + 2 * n + o, mask=ok, other=neg_inf)
    gi = tl.load(IPART + o, mask=ok, other=big)
    ri = tl.load(IPART + n + o, mask=ok, other=big)
    mx, total, g_tok, r_best, r_tok = merge_splits(m, l, rv, gi, ri)
    t = tl.load(TEMP + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    tok = tl.where(greedy, g_tok, r_tok)
    x = tl.load(X + row.to(tl.int64) * stride_x + tok).to(tl.float32)
    # the same association as torch's log_softmax: (s - max) - log(sum)
    logp = (tl.math.div_rn(x, t) - mx) - _log(total)
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LOGP + row, logp)


def launch_shape(batch: int, vocab: int, device: torch.device, block: int = 2048,
                 programs_per_sm: int = 4) -> tuple[int, int]:
    """(n_splits, n_tiles): split each row until ~programs_per_sm programs per SM are in
    flight, at most one split per tile. A pure function of (batch, vocab, device), so a
    graph captured for a batch size replays the same launch."""
    n_tiles = triton.cdiv(vocab, block)
    want = programs_per_sm * num_sms(device)
    return max(1, min(n_tiles, triton.cdiv(want, batch))), n_tiles


# Programs of ``_partial_kernel`` that fit on one sm90 SM at once, by (BLOCK, num_warps): 65,536
# registers / (registers per thread x threads), registers from ``bench/sampler_kernel.py --offline``
# (triton 3.6: 97 at 2048 x 8 warps -> 2 programs, 16 warps per SM; 56 at 1024 x 8 -> 4; 91 at 1024 x 4 -> 5).
RESIDENT_PER_SM = {(2048, 8): 2, (1024, 8): 4, (1024, 4): 5, (2048, 4): 3, (4096, 8): 1}


def wave_launch_shape(batch: int, vocab: int, device: torch.device, block: int, resident: int) -> tuple[int, int]:
    """(n_splits, n_tiles) for whole waves: with ``resident`` programs per SM at once, a launch of P
    programs takes ceil(P / slots) waves, each as long as its programs' ``ceil(n_tiles / splits)``
    tiles plus about one tile's worth of fixed cost (the lane reductions and partial stores), so the
    split count minimizing ``waves x (tiles per program + 1)`` wins (fewest splits on a tie: less to
    combine). ``launch_shape`` asks for 4 programs per SM where 2 fit: batch 128 x 151,936 got 5
    splits = 640 programs = 2.4 waves of 264, the last 42% full (3 x 16 = 48 tile-times; 2 splits:
    1 x 39). Pure in (batch, vocab, device)."""
    n_tiles = triton.cdiv(vocab, block)
    slots = max(1, resident) * num_sms(device)

    def cost(splits: int) -> int:
        return triton.cdiv(batch * splits, slots) * (triton.cdiv(n_tiles, splits) + 1)

    return min(range(1, n_tiles + 1), key=cost), n_tiles


# The vocab tile: 1024 x 8 warps measured faster than 2048 x 8 on the H200 at every batch
# (bench/sampler_kernel.py --waves-only, 2026-12-02, 151,936 vocab: 0.102 vs 0.107 ms at 128 rows,
# 0.198 vs 0.202 at 256, 0.364 vs 0.392 at 512; 56 registers a thread -> 4 programs an SM, the 4
# ``launch_shape`` asks for). The wave-sized launch (``waves``) was not faster at either tile.
DEFAULT_BLOCK = 1024


def sample_unfiltered(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                      block: int = DEFAULT_BLOCK, num_warps: int = 8, programs_per_sm: int = 4,
                      waves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[B, V]`` (any float dtype, unit stride along V), temperature ``[B]`` fp32
    (<= 0: greedy), keys ``[B]`` int64 (< 2^32, from ``row_keys``)
    -> (tokens ``[B]`` int64, logprobs ``[B]`` fp32): ``sample(..., use_filter=False)``.
    ``waves``: splits from ``wave_launch_shape`` (the programs that fit per SM, in whole waves)
    instead of ``launch_shape``; opt-in (measured no faster on the H200, ``DEFAULT_BLOCK``)."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    keys = keys.contiguous()
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return tokens, logprobs
    if waves and (block, num_warps) in RESIDENT_PER_SM:
        n_splits, n_tiles = wave_launch_shape(B, V, logits.device, block, RESIDENT_PER_SM[block, num_warps])
    else:
        n_splits, n_tiles = launch_shape(B, V, logits.device, block, programs_per_sm)
    part = torch.empty(3, B, n_splits, dtype=torch.float32, device=logits.device)
    ipart = torch.empty(2, B, n_splits, dtype=torch.int32, device=logits.device)
    _partial_kernel[(B, n_splits)](logits, logits.stride(0), V, temperature, keys, part, ipart,
                                   n_splits, n_tiles, BLOCK=block, U_HI=U_MAX, num_warps=num_warps)
    _combine_kernel[(B,)](logits, logits.stride(0), temperature, part, ipart, tokens, logprobs,
                          n_splits, MAX_SPLITS=max(16, triton.next_power_of_2(n_tiles)), num_warps=1)
    return tokens, logprobs


def noise(keys: torch.Tensor, vocab: int, block: int = 1024) -> torch.Tensor:
    """keys ``[B]`` int64 -> the kernel's Gumbel noise ``[B, vocab]`` fp32 (tests: must equal
    ``gumbel_noise(keys, vocab)`` bit for bit)."""
    g = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    _noise_kernel[(keys.shape[0], triton.cdiv(vocab, block))](keys.contiguous(), g, vocab,
                                                              BLOCK=block, U_HI=U_MAX)
    return g


def race_values(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                tokens: torch.Tensor) -> torch.Tensor:
    """Torch reference race value ``logp + g`` ``[B]`` of the given tokens (``sample``'s
    arithmetic): tells a rounding-level near tie from a real disagreement in checks."""
    t = torch.where(temperature <= 0, 1.0, temperature)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    race = logp + gumbel_noise(keys, logits.shape[-1])
    return race.gather(1, tokens[:, None]).squeeze(1)
