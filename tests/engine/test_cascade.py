"""Cascade (shared-prefix) decode attention on CPU: the plan finds the groups that share
blocks, and the split + LSE merge equals plain attention (float64)."""
import numpy as np
import pytest
import torch

from asyncrl.engine.cascade import (CascadeBuffers, cascade_attention_reference, merge_attention,
                                    partial_attention, plan_cascade, plan_size, tile_shape)


def _tables(groups, page, prefix_blocks, suffix_lens, nb_extra=0, seed=0):
    """Block tables for ``groups`` (members per group): the members of group g share
    ``prefix_blocks[g]`` leading blocks, then own blocks for their suffix tokens.
    Returns (tables, ctx, num_blocks); physical ids are a random permutation."""
    need = sum(p for p in prefix_blocks) + sum(-(-s // page) for s in suffix_lens) + nb_extra
    rng = np.random.default_rng(seed)
    ids = iter(rng.permutation(need).tolist())
    tables, ctx, i = [], [], 0
    for g, members in enumerate(groups):
        shared = [next(ids) for _ in range(prefix_blocks[g])]
        for _ in range(members):
            s = suffix_lens[i]
            tables.append(shared + [next(ids) for _ in range(-(-s // page))])
            ctx.append(prefix_blocks[g] * page + s)
            i += 1
    return tables, np.array(ctx), need


def _pad(tables, width, fill):
    return np.array([t + [fill] * (width - len(t)) for t in tables], dtype=np.int32)


def plain_attention(q, kc, vc, tables, ctx, scale):
    out = torch.empty_like(q)
    hkv, gqa = kc.shape[2], q.shape[1] // kc.shape[2]
    page = kc.shape[1]
    for b, t in enumerate(tables):
        tok = torch.arange(int(ctx[b]))
        blk = torch.as_tensor(t)[tok // page]
        k, v = kc[blk, tok % page], vc[blk, tok % page]  # [L, Hkv, D]
        for h in range(q.shape[1]):
            p = torch.softmax(q[b, h] @ k[:, h // gqa].T * scale, -1)
            out[b, h] = p @ v[:, h // gqa]
    return out


def test_plan_groups_members_and_tiles():
    page = 4
    # group 0: 5 members share 3 blocks; group 1: 2 share 2; a singleton; group 3: 3 share 1
    groups, prefix = [5, 2, 1, 3], [3, 2, 2, 1]
    suffix = [1, 3, 4, 5, 9, 1, 2, 7, 1, 1, 6]
    tables, ctx, nb = _tables(groups, page, prefix, suffix)
    order = np.random.default_rng(1).permutation(len(tables))  # groups interleaved in the batch
    tables, ctx = [tables[i] for i in order], ctx[order]
    bt = _pad(tables, 8, nb)
    _, mpt = tile_shape(8)  # GQA 8 -> 4 members per tile
    assert mpt == 4
    plan = plan_cascade(bt, ctx, page, mpt, bs=16, min_saved_fraction=0.0)
    member_of, leaders = {}, []
    for t in range(plan.num_tiles):
        leader, plen, *rows = plan.tiles[t].tolist()
        leaders.append((leader, plen))
        for r in (r for r in rows if r >= 0):
            assert tables[r][: plen // page] == tables[leader][: plen // page]
            member_of[r] = plen
    assert all(member_of[leader] == plen for leader, plen in leaders)  # the leader is a member
    assert plan.num_tiles == 2 + 1 + 1  # 5 members -> 2 tiles of <= 4; then 2; then 3
    assert (plan.tiles[plan.num_tiles:, 1] == 0).all() and (plan.tiles[plan.num_tiles:, 2:] == -1).all()
    sizes = {3 * page: 5, 2 * page: 2, 1 * page: 3}
    assert sorted(member_of.values()) == sorted(k for k, v in sizes.items() for _ in range(v))
    for b in range(len(tables)):
        assert plan.suffix_start[b] == member_of.get(b, 0)
    assert (plan.suffix_start[len(tables):] == 0).all()  # padded rows
    assert plan.saved_tokens == (4 * 3 + 1 * 2 + 2 * 1) * page


def test_plan_caps_at_full_blocks_before_the_current_token():
    page = 4
    # two rows with identical tables whose current token sits in the shared 2nd block's
    # successor: ctx 9 -> current token 8 is in block 2, blocks 0..1 are shareable
    bt = np.array([[7, 8, 9], [7, 8, 10]], dtype=np.int32)
    plan = plan_cascade(bt, np.array([9, 9]), page, 16, min_saved_fraction=0.0)
    assert plan.suffix_start.tolist() == [8, 8]
    # identical padding (scratch) past the real blocks never counts as shared
    bt = np.array([[7, 99, 99], [7, 99, 99]], dtype=np.int32)
    assert plan_cascade(bt, np.array([3, 3]), page, 16, min_saved_fraction=0.0) is None
    plan = plan_cascade(np.array([[7, 5, 99], [7, 6, 99]], dtype=np.int32), np.array([6, 5]), page, 16,
                        min_saved_fraction=0.0)
    assert plan.suffix_start.tolist() == [4, 4]


def test_plan_none_without_sharing_or_below_threshold():
    page = 4
    tables, ctx, nb = _tables([1, 1, 1], page, [2, 2, 2], [3, 3, 3])
    assert plan_cascade(_pad(tables, 4, nb), ctx, page, 16, min_saved_fraction=0.0) is None
    # one block shared by 2 rows of 100 tokens each saves 4 of 200 tokens (2%) < 10%
    tables, ctx, nb = _tables([2], page, [1], [96, 96])
    assert plan_cascade(_pad(tables, 30, nb), ctx, page, 16) is None
    assert plan_cascade(_pad(tables, 30, nb), ctx, page, 16, min_saved_fraction=0.0) is not None


def test_merge_of_disjoint_parts_equals_whole():
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 8, dtype=torch.float64), torch.randn(20, 8, dtype=torch.float64), torch.randn(20, 8, dtype=torch.float64)
    whole, lse = partial_attention(q, k, v, 0.3)
    a, la = partial_attention(q, k[:13], v[:13], 0.3)
    b, lb = partial_attention(q, k[13:], v[13:], 0.3)
    merged, lm = merge_attention(a, la, b, lb)
    assert torch.allclose(merged, whole, atol=1e-12) and torch.allclose(lm, lse, atol=1e-12)
    empty, le = partial_attention(q, k[:0], v[:0], 0.3)  # an empty part weighs nothing
    assert torch.equal(merge_attention(empty, le, whole, lse)[0], whole)


@pytest.mark.parametrize("H,Hkv,page", [(16, 8, 4), (4, 1, 8), (12, 4, 4)])
def test_reference_cascade_equals_plain_attention_float64(H, Hkv, page):
    torch.manual_seed(0)
    D = 8
    groups, prefix = [5, 1, 3, 2], [3, 2, 1, 4]
    suffix = [1, 2, 5, 9, 4, 3, 1, 6, 2, 1, 8]
    tables, ctx, nb = _tables(groups, page, prefix, suffix, nb_extra=1)
    kc = torch.randn(nb + 1, page, Hkv, D, dtype=torch.float64)
    vc = torch.randn(nb + 1, page, Hkv, D, dtype=torch.float64)
    q = torch.randn(len(tables), H, D, dtype=torch.float64)
    _, mpt = tile_shape(H // Hkv)
    plan = plan_cascade(_pad(tables, 12, nb), ctx, page, mpt, min_saved_fraction=0.0)
    assert plan is not None and plan.num_tiles >= 3
    out = cascade_attention_reference(q, kc, vc, tables, ctx, plan, D ** -0.5)
    ref = plain_attention(q, kc, vc, tables, ctx, D ** -0.5)
    assert (out - ref).abs().max().item() < 1e-12


def test_buffers_views_are_fixed_per_bucket():
    bufs = CascadeBuffers(16, 8, 4, 64, torch.device("cpu"))
    tables, ctx, nb = _tables([3, 2], 4, [2, 2], [1, 2, 3, 4, 1])
    plan = bufs.plan(_pad(tables, 6, nb), ctx, 16)
    s, t = bufs.load(plan, 16)
    assert s.data_ptr() == bufs.views(16)[0].data_ptr() and t.shape == (1 + 8, 2 + bufs.mpt)
    assert s.tolist() == plan.suffix_start.tolist() and torch.equal(t[1:], torch.from_numpy(plan.tiles))
    assert t[0, 0].item() == plan.num_tiles == 2  # header: active tiles
    assert bufs.buf.numel() == plan_size(64, bufs.mpt) and bufs.steps == 1
    bufs.enabled = False
    assert bufs.plan(_pad(tables, 6, nb), ctx, 16) is None


def test_prefix_splits_rule_fills_the_sms_with_few_groups():
    """The rule's hand-derived picks: ``prefix_fill=0`` = 1 split always; with ``prefix_fill`` the
    fewest power-of-2 chunks making ``tiles x kv heads x splits >= fill x SMs``, capped by
    ``max_prefix_splits`` and by chunks of ``min_chunk_tokens``. The defaults (fill 1, at most 2):
    2 chunks at the GRPO shape (128 items < 132 SMs), 1 at workload (b) (256 items)."""
    from asyncrl.engine.cascade import CascadeLaunchRule, prefix_splits_for

    assert prefix_splits_for(16, 8, 256, 132, CascadeLaunchRule(prefix_fill=0.0)) == 1  # the launch before
    assert prefix_splits_for(16, 8, 256, 132, CascadeLaunchRule()) == 2  # the defaults, GRPO shape
    assert prefix_splits_for(32, 8, 1024, 132, CascadeLaunchRule()) == 1  # the defaults, workload (b)
    assert prefix_splits_for(16, 8, 64, 132, CascadeLaunchRule()) == 1  # one chunk's worth of prefix
    rule = CascadeLaunchRule(prefix_fill=2.0, max_prefix_splits=8, min_chunk_tokens=64)
    # GRPO peer shape: 16 tiles x 8 heads = 128 items; 264 wanted -> 4 (512), 2 gives only 256
    assert prefix_splits_for(16, 8, 256, 132, rule) == 4
    assert prefix_splits_for(16, 8, 128, 132, rule) == 2  # 2 chunks of 64 tokens at most
    assert prefix_splits_for(16, 8, 63, 132, rule) == 1   # shorter than one chunk
    assert prefix_splits_for(2, 8, 4096, 132, rule) == 8  # capped by max_prefix_splits
    assert prefix_splits_for(32, 8, 1024, 132, rule) == 2  # workload (b): 256 items, 264 wanted
    assert prefix_splits_for(32, 8, 1024, 132, CascadeLaunchRule(prefix_fill=1.0)) == 1
    assert CascadeLaunchRule(prefix_fill=0.0).max_splits == 1 and rule.max_splits == 8
    assert CascadeLaunchRule().max_splits == 2


def test_rule_from_env_parses_and_names_bad_values():
    from asyncrl.engine.cascade import CascadeLaunchRule, rule_from_env

    assert rule_from_env("") == CascadeLaunchRule()
    assert rule_from_env("prefix_fill=1.5, max_prefix_splits=4") == CascadeLaunchRule(prefix_fill=1.5,
                                                                                       max_prefix_splits=4)
    assert rule_from_env("suffix_kv_splits=0,suffix_block_n=32").suffix_block_n == 32
    for bad, word in (("fill=1", "unknown key 'fill'"), ("prefix_fill=x", "prefix_fill='x' is not a number"),
                      ("max_prefix_splits=0", "must be >= 1"), ("suffix_kv_splits=3", "power of 2"),
                      ("small_batch_rows=-1", "small_batch_rows"), ("small_suffix_warps=0", "small suffix")):
        with pytest.raises(ValueError, match=word):
            rule_from_env(bad)


def test_buffers_write_the_rules_prefix_splits_into_the_header(monkeypatch):
    """The per-step chunk count travels in header slot 1 (the kernels read it on the device)."""
    from asyncrl.engine import cascade

    tables, ctx, nb = _tables([3, 2], 4, [2, 4], [1, 2, 3, 4, 1])
    bufs = CascadeBuffers(16, 8, 4, 64, torch.device("cpu"), sms=8)
    _, t = bufs.load(bufs.plan(_pad(tables, 6, nb), ctx, 16), 16)
    assert t[0, :2].tolist() == [2, 1]  # default rule: one chunk (16 items >= 8 SMs; a 16-token prefix)
    monkeypatch.setattr(cascade, "CASCADE_RULE", cascade.CascadeLaunchRule(prefix_fill=4.0, min_chunk_tokens=4))
    plan = bufs.plan(_pad(tables, 6, nb), ctx, 16)
    # 2 tiles x 8 kv heads = 16 items, 32 wanted -> 2; the longest prefix (16 tokens) allows 4
    assert plan.prefix_splits == 2 and plan.max_prefix_tokens == 16
    _, t = bufs.load(plan, 16)
    assert t[0, :2].tolist() == [2, 2]
    assert bufs.steps == 2 and bufs.prefix_chunks == 1 + 2


def _fresh(bufs, tables, ctx, bs):
    """What ``bufs.plan`` must return: a fresh ``plan_cascade`` with the launch rule applied."""
    from asyncrl.engine import cascade

    p = plan_cascade(tables, ctx, bufs.block_size, bufs.mpt, bs, bufs.min_saved_fraction)
    if p is not None:
        p.prefix_splits = cascade.prefix_splits_for(p.num_tiles, bufs.num_kv_heads, p.max_prefix_tokens, bufs.sms,
                                                    cascade.CASCADE_RULE)
    return p


def _same_plan(a, b):
    if a is None or b is None:
        return a is b
    return (a.num_tiles, a.saved_tokens, a.prefix_splits) == (b.num_tiles, b.saved_tokens, b.prefix_splits) \
        and np.array_equal(a.packed(), b.packed())


def test_plan_reuse_follows_every_input_the_plan_reads(monkeypatch):
    """A reused plan equals a fresh ``plan_cascade``, and it is reused exactly when the inputs the
    plan reads are unchanged: the bucket, each row's full-block count, the block-table columns
    below the largest count. The saved-fraction test and the launch rule apply per step."""
    from asyncrl.engine import cascade

    tables, ctx, nb = _tables([3, 2], 4, [2, 4], [1, 2, 3, 4, 1])  # ctx [9, 10, 11, 20, 17]: caps [2, 2, 2, 4, 4]
    t = _pad(tables, 8, nb)
    t_moved = t.copy()
    t_moved[3, 1] = nb + 1  # a shared block id of row 3 changes (a column the plan reads)
    ctx_in = ctx + np.array([1, 1, 1, 0, 2])  # [10, 11, 12, 20, 19]: every row stays in its blocks
    ctx_cross = ctx_in + np.array([0, 0, 0, 1, 0])  # row 3 at 21: a 5th full block
    bufs = CascadeBuffers(16, 8, 4, 64, torch.device("cpu"), sms=8)
    steps = [  # (tables, ctx, bucket, reused)
        (t, ctx, 16, False), (t, ctx, 16, True), (t, ctx_in, 16, True), (t, ctx_cross, 16, False),
        (t, ctx_cross, 16, True), (t_moved, ctx_cross, 16, False), (t_moved, ctx_cross, 32, False),
        (t_moved[:4], ctx_cross[:4], 32, False), (t_moved[:4], ctx_cross[:4], 32, True)]
    for tab, c, bs, reused in steps:
        before = bufs.plans_reused
        assert _same_plan(bufs.plan(tab, c, bs), _fresh(bufs, tab, c, bs))
        assert bufs.plans_reused - before == reused
    # the saved-fraction test sees this step's contexts: a reused grouping that no longer saves enough
    bufs.min_saved_fraction = 0.43  # ctx_in: 32 tokens saved of 72 (0.444)
    assert bufs.plan(t, ctx_in, 16) is not None
    longer = np.array([12, 12, 12, 20, 20])  # the same caps; 32 of 76 (0.421)
    assert _fresh(bufs, t, longer, 16) is None and bufs.plan(t, longer, 16) is None
    assert bufs.plans_reused - before == 2
    # the launch rule is applied per step: a reused grouping takes a changed rule
    monkeypatch.setattr(cascade, "CASCADE_RULE", cascade.CascadeLaunchRule(prefix_fill=4.0, min_chunk_tokens=4))
    bufs.min_saved_fraction = cascade.MIN_SAVED_FRACTION
    p = bufs.plan(t, ctx_in, 16)
    assert _same_plan(p, _fresh(bufs, t, ctx_in, 16)) and p.prefix_splits == 2
    bufs.reuse = False  # the bench's A/B switch: plans afresh
    before = bufs.plans_reused
    assert _same_plan(bufs.plan(t, ctx_in, 16), p) and bufs.plans_reused == before


def test_plan_reuse_equals_fresh_plans_through_a_scheduled_run():
    """Decode batches of the real scheduler (forked GRPO groups, rows finishing at different lengths,
    requests arriving mid-run, preemption in a small pool, a weight update that drops the K/V): at
    every decode step the reused plan equals a fresh ``plan_cascade``; plans are both reused and
    recomputed along the way."""
    from asyncrl.engine.block_manager import BlockManager
    from asyncrl.engine.config import EngineConfig
    from asyncrl.engine.scheduler import Scheduler
    from asyncrl.engine.sequence import Sequence
    from asyncrl.types import SamplingParams

    page, width = 4, 16
    bm = BlockManager(70, page, max_blocks_per_seq=width)
    sc = Scheduler(EngineConfig(block_size=page, max_num_seqs=24, max_num_batched_tokens=64), bm, page * width, [0])
    rng = np.random.default_rng(0)

    def add(i):
        s = Sequence(rng.integers(1, 50, int(rng.integers(5, 14))).tolist(),
                     SamplingParams(n=4, max_tokens=int(rng.integers(6, 30)), ignore_eos=True), str(i), 0, i)
        s.num_forks = 3
        sc.add(s)

    for i in range(4):
        add(i)
    bufs = CascadeBuffers(16, 8, page, 32, torch.device("cpu"), sms=8)
    decode_steps = 0
    for step in range(160):
        if step in (10, 25, 40):
            add(100 + step)
        if step == 60:
            sc.drop_kv()  # update_weights(kv="recompute")
        batch = sc.schedule()
        if batch is None:
            break
        if not batch.is_prefill:
            decode_steps += 1
            n = len(batch.seqs)
            bs = 32 if n > 16 else 16
            tab, ctx = batch.block_tables, np.asarray(batch.starts) + 1
            assert _same_plan(bufs.plan(tab, ctx, bs), _fresh(bufs, tab, ctx, bs))
        k = len(batch.sample_seqs)
        sc.postprocess(batch, rng.integers(1, 50, k).tolist(), [0.0] * k, 0)
    assert sc.num_preemptions > 0 and decode_steps > 60
    assert 0 < bufs.plans_reused < decode_steps and bufs.steps > 0
