"""Shared-prefix (cascade) decode attention: plan, buffers, pure-torch reference.

The n samples of a GRPO prompt share the prompt's full KV blocks (``BlockManager.fork``,
or prefix-cache hits). Plain paged decode makes every sample read that shared K/V again.
Cascade attention splits each sequence's context at ``suffix_start``:

  * prefix ``[0, suffix_start)``: the group's shared full blocks. Attended ONCE per
    (group, kv head) with all members' queries stacked into one tile (members x GQA
    heads rows), so the prefix K/V is read once per group and the scores are a real
    matmul (tensor cores);
  * suffix ``[suffix_start, ctx)``: each sequence's own blocks, attended per sequence;
  * the two partial results are merged by their log-sum-exp (``merge_attention``).

Groups come from the block tables, not from the scheduler: rows whose tables start with
the same block id share a prefix, and the longest common run of block ids (capped at the
full blocks before each row's current token) is content shared by construction (tables
are append-only; a block with ref_count > 1 is never written). So fork groups and
prefix-cache hits across requests are both found, with no scheduler state.

Plan layout (one int32 buffer per step, fixed size per batch bucket so CUDA graphs can
replay it): ``[suffix_start (bs) | header (2 + MPT) | tiles (max_tiles x (2 + MPT))]``,
the header row starting with the number of active tiles (the prefix kernel's persistent
grid walks only those, and then the number of chunks each tile's prefix is split into this
step, ``CascadeLaunchRule``), a tile row being ``(leader row, prefix length in tokens, MPT
member rows padded with -1)``. Unused tiles have prefix length 0 and no members; rows
outside any group have ``suffix_start = 0``.

This module imports no Triton (CPU CI imports it); kernels are in ``triton_decode.py``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# Cascade only when the shared prefix reads saved are at least this share of all the
# context tokens of the step: below it the extra launch and merge are not worth it.
MIN_SAVED_FRACTION = 0.1


@dataclass(frozen=True)
class CascadeLaunchRule:
    """The cascade kernels' launch shape, and how it follows the decode step's shape (issue 23).

    Prefix kernel: ``tiles x kv heads`` work items of ``prefix / prefix_block_n`` loop iterations.
    With few groups (GRPO: 16 prompts x 8 samples -> 16 tiles x 8 kv heads = 128 items on 132
    SMs, 4 iterations each) it is latency-bound; splitting each tile's prefix into ``s`` chunks
    (merged by log-sum-exp in the suffix kernel) gives ``s`` x the items of ``1/s`` the
    iterations. ``prefix_splits_for`` picks the fewest power-of-2 ``s`` with ``items x s >=
    prefix_fill x SMs``, at most ``max_prefix_splits``, chunks of at least ``min_chunk_tokens``.

    When each choice is made (CUDA graphs: one graph per batch bucket, replayed every step):
      * per step, graph-safe: the prefix chunk count. It travels in the plan's header (a device
        buffer the kernels read); the persistent grid and the partials' buffer are sized for
        ``max_splits``.
      * per process (constexprs and grids, the same in every graph): ``prefix_programs_per_sm``,
        ``prefix_block_n``, ``prefix_warps``, ``max_prefix_splits``, and the suffix decode's
        ``suffix_block_n`` / ``suffix_warps`` / ``suffix_stages`` (0 = the plain decode's,
        ``triton_decode.DECODE_LAUNCH``), ``suffix_early_prefix``, ``concurrent_prefix``,
        ``prefix_prefetch`` and ``suffix_prefetch`` (per cache dtype).
      * per batch bucket: ``suffix_kv_splits`` (split-KV of each row's own ``[suffix_start,
        ctx)``, a grid dimension; 1 = none, 0 = the plain kernel's per-batch rule
        ``kv_splits_for``). The suffix length is not an input of any graph-fixed choice: a
        split-KV chunk past a row's length is empty and exits early.

      * per batch bucket: the suffix launch of small batches (``small_batch_rows``): at most that
        many rows take ``small_suffix_block_n`` / ``small_suffix_warps`` (unless ``suffix_block_n``
        / ``suffix_warps`` are set, which win at every batch size).

    The defaults are the sweep's pick on an H200 (``bench/cascade_decode.py --shape peer,b``,
    2026-12-02, bench/RESULTS.md): the GRPO shape (16 groups x 8, prefix 256, batch 128) gets 2
    prefix chunks (128 items < 132 SMs; 14.1 -> 10.9 us for the prefix kernel) and the 16-token,
    2-warp suffix tile (9.6 -> 4.8 us at a 1-token suffix, 37.9 -> 36.6 at 256); workload (b)
    (32 groups x 16, prefix 1,024, batch 512) keeps 1 chunk and the plain decode's suffix tile,
    which the 16-token tile loses to at 512 rows from a 64-token suffix on (40.9 -> 43.3 us).
    Batches between 128 and 512 rows were not measured: the threshold is the measured side.
    ``bench/cascade_decode.py`` prints the ``ASYNCRL_CASCADE_LAUNCH`` its sweep would set.
    """

    prefix_fill: float = 1.0       # 0 = never split the prefix; 1 = split while items < SMs
    max_prefix_splits: int = 2     # cap, and the partials' buffer depth when prefix_fill > 0
    min_chunk_tokens: int = 64     # a chunk holds at least this many prefix tokens
    prefix_programs_per_sm: int = 4
    prefix_block_n: int = 64
    prefix_warps: int = 4
    suffix_kv_splits: int = 1      # 1 = no split-KV under cascade (the default), 0 = per batch
    suffix_block_n: int = 0        # 0 = DECODE_LAUNCH's
    suffix_warps: int = 0
    suffix_stages: int = 0
    suffix_early_prefix: int = 0   # 1 = the suffix kernel loads prefix part 0 before its loop (EARLY_PREFIX)
    small_batch_rows: int = 128    # batches of at most this many rows take the small suffix tile (0 = never)
    small_suffix_block_n: int = 16
    small_suffix_warps: int = 2
    # 1 = the prefix kernel runs on a side stream beside a suffix kernel that does not read its
    # partials, then a merge kernel (triton_decode.concurrent_cascade; per process, read when a
    # graph is captured). 0 = serialized: the suffix kernel merges the prefix partials itself.
    concurrent_prefix: int = 0
    # Block ids loaded a tile ahead (triton_decode.bt_prefetch: the K/V copies pipeline): 2 = on every
    # cache, 1 = on e4m3 caches, 0 = off. H200, summed over suffix lengths (bench/cascade_prefetch.py,
    # 2026-12-04): the prefix kernel gains on both dtypes (bf16 1.03x at the GRPO shape, 1.11x at
    # workload (b); e4m3 1.05x / 1.13x); the suffix gains on e4m3 (1.05x / 1.07x) and loses bf16 at
    # 512 rows (0.94x).
    suffix_prefetch: int = 1
    prefix_prefetch: int = 2

    @property
    def max_splits(self) -> int:
        """Depth of the prefix partials' buffer (and of the kernel's grid)."""
        return self.max_prefix_splits if self.prefix_fill > 0 else 1


def prefix_splits_for(num_tiles: int, num_kv_heads: int, prefix_tokens: int, sms: int,
                      rule: CascadeLaunchRule) -> int:
    """Chunks per prefix tile this step (a power of 2): 1 unless ``rule.prefix_fill > 0``; else
    the fewest with ``num_tiles x num_kv_heads x splits >= prefix_fill x sms``, capped by
    ``rule.max_prefix_splits`` and by ``prefix_tokens // rule.min_chunk_tokens`` (the longest
    prefix of the step). Pure: the engine calls it per step on the host."""
    if rule.prefix_fill <= 0:
        return 1
    cap = max(1, min(rule.max_prefix_splits, prefix_tokens // max(1, rule.min_chunk_tokens)))
    splits, target = 1, rule.prefix_fill * sms
    while splits * 2 <= cap and num_tiles * num_kv_heads * splits < target:
        splits *= 2
    return splits


def rule_from_env(raw: Optional[str] = None) -> CascadeLaunchRule:
    """``ASYNCRL_CASCADE_LAUNCH="prefix_fill=2,suffix_block_n=32"`` (``CascadeLaunchRule``'s
    fields, any subset; bench/cascade_decode.py prints the measured best in this form); unset:
    the defaults. A bad key or value raises naming it."""
    raw = os.environ.get("ASYNCRL_CASCADE_LAUNCH", "") if raw is None else raw
    fields = [f.name for f in dataclasses.fields(CascadeLaunchRule)]
    values = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in fields:
            raise ValueError(f"ASYNCRL_CASCADE_LAUNCH: unknown key {key!r} (keys: {', '.join(fields)})")
        try:
            values[key] = float(value) if key == "prefix_fill" else int(value)
        except ValueError:
            raise ValueError(f"ASYNCRL_CASCADE_LAUNCH: {key}={value.strip()!r} is not a number") from None
    rule = CascadeLaunchRule(**values)
    if rule.max_prefix_splits < 1 or min(rule.prefix_programs_per_sm, rule.prefix_block_n, rule.prefix_warps) < 1:
        raise ValueError("ASYNCRL_CASCADE_LAUNCH: max_prefix_splits and the prefix launch must be >= 1")
    if rule.small_batch_rows < 0 or min(rule.small_suffix_block_n, rule.small_suffix_warps) < 1:
        raise ValueError("ASYNCRL_CASCADE_LAUNCH: small_batch_rows must be >= 0 and the small suffix launch >= 1")
    if rule.suffix_kv_splits < 0 or rule.suffix_kv_splits & (rule.suffix_kv_splits - 1):
        raise ValueError("ASYNCRL_CASCADE_LAUNCH: suffix_kv_splits must be 0 (per batch) or a power of 2")
    return rule


# The process's rule (read when the engine plans a step and when a kernel launches).
CASCADE_RULE = rule_from_env()


def tile_shape(gqa: int) -> tuple[int, int]:
    """(BLOCK_M query rows of a prefix tile, members per tile MPT) for ``gqa`` q heads
    per kv head: at least 32 rows (a full tensor-core tile) and a power of two."""
    block_m = max(32, 1 << (gqa - 1).bit_length())
    return block_m, block_m // gqa


def max_tiles(bs: int, mpt: int) -> int:
    """Upper bound on tiles for ``bs`` rows: every group has >= 2 members, so with
    MPT >= 2 each tile covers >= 2 rows."""
    return max(1, bs // 2 if mpt >= 2 else bs)


def plan_size(bs: int, mpt: int) -> int:
    return bs + (1 + max_tiles(bs, mpt)) * (2 + mpt)


@dataclass
class CascadePlan:
    """suffix_start ``[bs]`` int32 (tokens; 0 = not in a group), tiles ``[max_tiles, 2 + MPT]``
    int32, ``num_tiles`` active tiles (the rest inert), ``saved_tokens`` prefix reads saved,
    ``prefix_splits`` chunks per tile's prefix (``prefix_splits_for``)."""

    suffix_start: np.ndarray
    tiles: np.ndarray
    num_tiles: int
    saved_tokens: int
    prefix_splits: int = 1
    # (prefix_splits, packed()) of the last ``packed`` call: a reused plan packs once (read-only array)
    _packed: Optional[tuple[int, np.ndarray]] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def max_prefix_tokens(self) -> int:
        return int(self.tiles[:self.num_tiles, 1].max()) if self.num_tiles else 0

    def packed(self) -> np.ndarray:
        """The device layout: suffix_start, header row (num_tiles, prefix_splits, 0...), tiles."""
        if self._packed is None or self._packed[0] != self.prefix_splits:
            header = np.zeros(self.tiles.shape[1], dtype=np.int32)
            header[0], header[1] = self.num_tiles, self.prefix_splits
            self._packed = (self.prefix_splits, np.concatenate([self.suffix_start, header, self.tiles.ravel()]))
        return self._packed[1]


def plan_cascade(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, mpt: int,
                 bs: Optional[int] = None, min_saved_fraction: float = MIN_SAVED_FRACTION) -> Optional[CascadePlan]:
    """Find prefix groups among the ``n`` real rows of a decode step.

    block_tables ``[n, W]`` (entries past a row's blocks are ignored), context_lens ``[n]``
    (>= 1; the current token sits at position ``ctx - 1``). ``bs >= n``: padded rows
    (no group). Returns None when no group saves enough (use the plain kernel).
    Vectorised numpy: O(n W), no Python loop over rows.
    """
    n = len(context_lens)
    bs = n if bs is None else bs
    if n < 2:
        return None
    ctx = np.asarray(context_lens, dtype=np.int64)[:n]
    cap = (ctx - 1) // block_size  # full blocks before the current token's block
    if cap.max() < 1:
        return None
    bt = np.asarray(block_tables)[:n, :cap.max()]  # only columns that can be shared
    order = np.argsort(bt[:, 0], kind="stable")
    key = bt[order, 0]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    sizes = np.diff(np.r_[starts, n])
    leader = order[starts]  # first row (batch order) of each group
    eq = bt[order] == bt[np.repeat(leader, sizes)]
    lcp = np.argmin(np.concatenate([eq, np.zeros((n, 1), dtype=bool)], 1), 1)  # first mismatch
    lcp = np.minimum(lcp, cap[order])
    prefix = np.minimum.reduceat(lcp, starts)  # shared blocks of each group
    ok = (sizes >= 2) & (prefix >= 1)
    saved = int(((sizes - 1) * prefix * block_size)[ok].sum())
    if not ok.any() or saved < min_saved_fraction * ctx.sum():
        return None
    groups = np.flatnonzero(ok)
    per = -(-sizes[groups] // mpt)  # tiles per group
    first_tile = np.zeros(len(sizes), dtype=np.int64)
    first_tile[groups] = np.cumsum(per) - per
    num_tiles = int(per.sum())
    cap_tiles = max_tiles(bs, mpt)
    assert num_tiles <= cap_tiles, (num_tiles, cap_tiles)
    tiles = np.full((cap_tiles, 2 + mpt), -1, dtype=np.int32)
    tiles[:, :2] = 0
    tile_group = np.repeat(groups, per)
    tiles[:num_tiles, 0] = leader[tile_group]
    tiles[:num_tiles, 1] = prefix[tile_group] * block_size
    pos = np.flatnonzero(np.repeat(ok, sizes))  # sorted positions of grouped rows
    grp = np.repeat(np.arange(len(sizes)), sizes)[pos]
    r = pos - starts[grp]  # rank inside the group
    rows = order[pos]
    tiles[first_tile[grp] + r // mpt, 2 + r % mpt] = rows
    suffix = np.zeros(bs, dtype=np.int32)
    suffix[rows] = prefix[grp] * block_size
    return CascadePlan(suffix, tiles, num_tiles, saved)


class CascadeBuffers:
    """Device buffer of the plan, sliced per batch bucket (stable addresses for graphs), and the
    host planner of each decode step.

    Plan reuse (``reuse``): ``plan_cascade`` is a pure function of the step's rows that it reads --
    ``bs``, each row's full-block count ``cap = (ctx - 1) // block_size`` and the block-table
    columns ``[:n, :cap.max()]`` -- plus ``ctx.sum()`` in its saved-fraction test alone. So the last
    step's plan (computed without that test) is kept with those inputs, and a step whose inputs are
    equal (two small array compares) takes it, then applies the saved-fraction test and the launch
    rule itself. Between block boundaries of a decode batch whose rows did not change this is every
    step (the GRPO rollout: 4 plans per 256 steps); any change of membership, order, blocks or a row
    crossing into a new block recomputes, so the plan is always the one ``plan_cascade`` returns."""

    def __init__(self, num_heads: int, num_kv_heads: int, block_size: int, max_bs: int, device: torch.device,
                 min_saved_fraction: float = MIN_SAVED_FRACTION, sms: Optional[int] = None):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        # SMs for the launch rule (8 off CUDA, as the kernels' interpreter grid assumes)
        self.sms = sms or (torch.cuda.get_device_properties(device).multi_processor_count
                           if torch.device(device).type == "cuda" else 8)
        self.block_m, self.mpt = tile_shape(num_heads // num_kv_heads)
        self.min_saved_fraction = min_saved_fraction
        self.buf = torch.zeros(plan_size(max_bs, self.mpt), dtype=torch.int32, device=device)
        self.enabled = True  # bench toggles this to compare against the plain kernel
        self.reuse = True  # keep the last plan while its inputs are unchanged (class doc); bench A/B toggle
        # the last planned step: (bs, cap [n], block-table columns read [n, cap.max()], plan without the
        # saved-fraction test or None)
        self._last: Optional[tuple[int, np.ndarray, np.ndarray, Optional[CascadePlan]]] = None
        self._given: Optional[CascadePlan] = None  # the last plan returned (the grouping + this step's splits)
        self.steps = 0  # decode steps run with cascade (metrics)
        self.saved_tokens = 0
        self.prefix_chunks = 0  # sum over cascade steps of the prefix chunk count (mean = / steps)
        self.plans_reused = 0  # decode steps that took the last step's plan (metrics)

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(suffix_start ``[bs]``, tiles with header row ``[1 + max_tiles(bs), 2 + MPT]``)
        views of the buffer."""
        t = 1 + max_tiles(bs, self.mpt)
        return self.buf[:bs], self.buf[bs:bs + t * (2 + self.mpt)].view(t, 2 + self.mpt)

    def plan(self, block_tables: np.ndarray, context_lens: np.ndarray, bs: int) -> Optional[CascadePlan]:
        """``plan_cascade`` of the step (block_tables ``[n, W]``, context_lens ``[n]``, bucket ``bs``)
        with this process's launch rule applied; the same plan as a fresh ``plan_cascade`` call."""
        if not self.enabled or len(context_lens) < 2:
            return None
        ctx = np.asarray(context_lens, dtype=np.int64)
        p = self._grouping(np.asarray(block_tables), ctx, bs)
        if p is None or p.saved_tokens < self.min_saved_fraction * ctx.sum():
            return None
        splits = prefix_splits_for(p.num_tiles, self.num_kv_heads, p.max_prefix_tokens, self.sms, CASCADE_RULE)
        given = self._given
        if given is None or given.tiles is not p.tiles or given.prefix_splits != splits:  # else: the same plan again
            given = self._given = dataclasses.replace(p, prefix_splits=splits)
        p = given
        self.steps += 1
        self.saved_tokens += p.saved_tokens
        self.prefix_chunks += p.prefix_splits
        return p

    def _grouping(self, block_tables: np.ndarray, ctx: np.ndarray, bs: int) -> Optional[CascadePlan]:
        """``plan_cascade`` without the saved-fraction test: the last step's when its inputs are equal."""
        n = len(ctx)
        cap = (ctx - 1) // self.block_size
        last = self._last
        if (self.reuse and last is not None and last[0] == bs and np.array_equal(last[1], cap)
                and np.array_equal(block_tables[:n, :last[2].shape[1]], last[2])):
            self.plans_reused += 1
            return last[3]
        p = plan_cascade(block_tables, ctx, self.block_size, self.mpt, bs, min_saved_fraction=0.0)
        self._last = (bs, cap, block_tables[:n, :max(int(cap.max()), 0)].copy(), p)
        return p

    def load(self, plan: CascadePlan, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``plan`` (made for bucket ``bs``) into the buffer; returns ``views(bs)``."""
        packed = torch.from_numpy(plan.packed())
        self.buf[:packed.numel()].copy_(packed, non_blocking=True)
        return self.views(bs)


# ---- pure-torch reference (CPU/any dtype; the Triton kernels are tested against it) ----
def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q ``[M, D]``, k/v ``[L, D]`` -> (out ``[M, D]``, lse ``[M]``); L = 0 gives lse -inf."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], float("-inf"), dtype=q.dtype, device=q.device)
    s = (q @ k.T) * scale
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[:, None]) @ v, lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Attention over the union of two disjoint key sets from the parts' (out, lse):
    ``out = w_a o_a + w_b o_b`` with ``w = exp(lse - lse_union)``. Shapes ``[..., D]`` / ``[...]``."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)  # -inf - -inf: an empty part weighs 0
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


def _gather_kv(cache: torch.Tensor, table, start: int, end: int) -> torch.Tensor:
    """Tokens ``[start, end)`` of a sequence from ``cache [N, P, Hkv, D]`` -> ``[L, Hkv, D]``."""
    page = cache.shape[1]
    tok = torch.arange(start, end)
    blocks = torch.as_tensor(table, dtype=torch.long)[tok // page]
    return cache[blocks, tok % page]


def cascade_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables,
                                context_lens, plan: CascadePlan, scale: float) -> torch.Tensor:
    """Cascade attention in plain torch: q ``[B, H, D]`` -> ``[B, H, D]``.

    Each active tile attends its members' queries (all at once, per kv head) to the
    leader's first ``prefix`` tokens; each row attends ``[suffix_start, ctx)`` of its own
    table; the parts are merged by LSE. Equals plain attention over ``[0, ctx)``."""
    B, H, D = q.shape
    hkv = k_cache.shape[2]
    gqa = H // hkv
    o_p = torch.zeros_like(q)
    lse_p = torch.full((B, H), float("-inf"), dtype=q.dtype, device=q.device)
    for t in range(plan.num_tiles):
        leader, plen, *members = plan.tiles[t].tolist()
        members = [m for m in members if m >= 0]
        kp = _gather_kv(k_cache, block_tables[leader], 0, plen)
        vp = _gather_kv(v_cache, block_tables[leader], 0, plen)
        for h in range(hkv):
            heads = slice(h * gqa, (h + 1) * gqa)
            qm = q[members, heads].reshape(-1, D)  # members x GQA rows: one tile
            o, lse = partial_attention(qm, kp[:, h].to(q.dtype), vp[:, h].to(q.dtype), scale)
            o_p[members, heads] = o.view(len(members), gqa, D)
            lse_p[members, heads] = lse.view(len(members), gqa)
    out = torch.empty_like(q)
    for b in range(B):
        ctx, start = int(context_lens[b]), int(plan.suffix_start[b])
        ks = _gather_kv(k_cache, block_tables[b], start, ctx).to(q.dtype)
        vs = _gather_kv(v_cache, block_tables[b], start, ctx).to(q.dtype)
        for h in range(hkv):
            heads = slice(h * gqa, (h + 1) * gqa)
            o, lse = partial_attention(q[b, heads], ks[:, h], vs[:, h], scale)
            out[b, heads] = merge_attention(o_p[b, heads], lse_p[b, heads], o, lse)[0]
    return out
