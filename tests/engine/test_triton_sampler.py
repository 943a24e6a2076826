"""Triton one-pass sampler (asyncrl/engine/triton_sampler.py) vs the torch ``sample``.

On CUDA the compiled kernels run (tests marked gpu). Without CUDA, with triton installed
and ``TRITON_INTERPRET=1`` in the environment, the same checks run on small cases through
the Triton interpreter (numpy's log there differs from torch's by an ulp, so the noise is
compared to a tolerance on CPU and bitwise on CUDA); otherwise the module is skipped."""
import os

import pytest
import torch

from asyncrl.engine.sampler import Sampler, gumbel_noise, row_keys, sample

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    # triton's own helpers are defined when triton is imported (conftest's imports may
    # already have): the flag must be set before the process starts
    pytest.skip("no CUDA: run with TRITON_INTERPRET=1 to use the Triton interpreter", allow_module_level=True)
pytest.importorskip("triton")
from asyncrl.engine import triton_sampler as ts  # noqa: E402
from test_triton_decode import _interpreter_index_on_numpy_2  # noqa: E402,F401  (autouse: numpy >= 2.3)

# GPU tests on CUDA (``-m gpu`` selects them); interpreter tests elsewhere, not skipped
pytestmark = [pytest.mark.gpu] if CUDA else []
TEMPS = [0.0, 0.7, 1.0, 1.0, 0.3, 1.5, 0.0]


def _case(B, V, dtype, seed=0):
    """Random logits ``[B, V]`` (spread like an LM's, a few -inf entries, repeated maxima in
    row 0), mixed temperatures incl. greedy ``[B]``, keys ``[B]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    p = V // 3  # greedy row 0: the first of repeated maxima, one tile width (2048) apart
    ties = [p, p + 2048, V - 1] if p + 2048 < V - 1 else [p, V // 2, V - 1]
    x[0, ties] = x[0].max() + 1
    if B > 1:
        x[1, : V // 10] = float("-inf")  # masked vocab
    temp = torch.tensor([TEMPS[i % len(TEMPS)] for i in range(B)], dtype=torch.float32)
    seeds = torch.arange(B, dtype=torch.int64) + 1000 * seed
    keys = row_keys(seeds, torch.zeros(B, dtype=torch.int64), seeds * 7 + 3)
    return x.to(dtype).to(DEV), temp.to(DEV), keys.to(DEV)


def _check_against_sample(x, temp, keys, tol, **launch):
    """Tokens equal to ``sample``'s (a race may flip only at a rounding-level tie: both
    tokens' torch race values within 1e-5; greedy rows never), log-probs within tol."""
    B = x.shape[0]
    tok, lp = ts.sample_unfiltered(x, temp, keys, **launch)
    ref_tok, ref_lp = sample(x, temp, torch.zeros(B, dtype=torch.int64, device=DEV),
                             torch.ones(B, device=DEV), keys, False)
    diff = (tok != ref_tok).nonzero().flatten()
    if len(diff):
        assert not (temp[diff] <= 0).any(), "greedy rows must match torch.argmax exactly"
        ra = ts.race_values(x[diff], temp[diff], keys[diff], tok[diff])
        rb = ts.race_values(x[diff], temp[diff], keys[diff], ref_tok[diff])
        assert ((ra - rb).abs() <= 1e-5 * rb.abs().clamp(min=1)).all(), (diff, ra, rb)
        assert len(diff) <= max(1, B // 1000), f"{len(diff)} near-tie flips in {B} rows"
    same = tok == ref_tok
    assert (lp[same] - ref_lp[same]).abs().max().item() < tol
    return tok, lp


def _sizes():
    if CUDA:
        return [(1, 151936), (7, 151936), (256, 151936), (1, 1000), (7, 1000), (256, 1000)]
    return [(1, 151936), (7, 1000), (5, 4099), (64, 1000)]  # the interpreter is slow


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
@pytest.mark.parametrize("B,V", _sizes())
def test_matches_torch_sample(B, V, dtype, tol):
    x, temp, keys = _case(B, V, dtype, seed=B + V)
    tok, _ = _check_against_sample(x, temp, keys, tol)
    assert tok[0].item() == V // 3 or temp[0] > 0  # the first of the repeated maxima


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_logits_match_torch_sample(dtype):
    """LM-like rows (a few candidates 15-20 nats above the bulk, in different tiles), one program
    per row or split rows: tokens equal ``sample``'s."""
    B, V = (64, 151936) if CUDA else (6, 9000)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, V, generator=g) * 2
    cand = torch.randint(0, V, (B, 4), generator=g)
    x.scatter_(1, cand, 15 + 5 * torch.rand(B, 4, generator=g))
    x = x.to(dtype).to(DEV)
    temp = torch.tensor([(0.7, 1.0, 1.5)[i % 3] for i in range(B)], device=DEV)
    seeds = torch.arange(B, dtype=torch.int64)
    keys = row_keys(seeds, seeds, seeds).to(DEV)
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    for programs_per_sm in (0, 4):  # 0: one program per row walks every tile
        tok, _ = _check_against_sample(x, temp, keys, tol, programs_per_sm=programs_per_sm)
        assert len(set(tok.tolist())) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_flat_rows_over_many_tiles_match_torch_sample(temperature):
    """Random-model-like rows (logits N(0, 0.5), as the benches' random-weight 0.6B model gives: no tile's
    noise can be skipped), one program per row walking many small tiles, at T = 1 and the division path:
    tokens equal ``sample``'s on every row, log-probs within 1e-4."""
    B, V = (512, 151936) if CUDA else (128, 2048)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(B, V, generator=g) * 0.5).to(DEV)
    temp = torch.full((B,), temperature, device=DEV)
    seeds = torch.arange(B, dtype=torch.int64)
    keys = row_keys(seeds, seeds + 5, seeds * 3).to(DEV)
    launches = [dict(programs_per_sm=0, block=64)] + ([dict(programs_per_sm=4)] if CUDA else [])
    for launch in launches:
        _check_against_sample(x, temp, keys, 1e-4, **launch)


@pytest.mark.parametrize("B,V,block,warps", [(7, 1000, 2048, 8), (24, 3000, 1024, 8)])
def test_wave_launch_matches_torch_sample(B, V, block, warps):
    """``waves=True`` (splits in whole waves of the programs that fit per SM): the same law."""
    x, temp, keys = _case(B, V, torch.float32, seed=B)
    _check_against_sample(x, temp, keys, 1e-4, block=block, num_warps=warps, waves=True)


def test_wave_launch_shape_fills_whole_waves(monkeypatch):
    """On 132 SMs with 2 programs each (264 slots) batch 128 takes 2 splits (one wave of 256; the
    default asks for 5: 640 programs, 2.4 waves); batch 1 one split per tile; never more than the tiles."""
    monkeypatch.setattr(ts, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert ts.launch_shape(128, 151936, cuda)[0] == 5
    assert ts.wave_launch_shape(128, 151936, cuda, 2048, 2) == (2, 75)
    assert ts.wave_launch_shape(1, 151936, cuda, 2048, 2) == (75, 75)
    for B in (3, 64, 200, 256, 512, 4096):
        splits, tiles = ts.wave_launch_shape(B, 151936, cuda, 1024, 4)
        assert 1 <= splits <= tiles and B * splits <= max(528, B) * 2  # at most two waves' worth


def test_noise_matches_gumbel_noise():
    # key 276830416 (seed 173) hashes index 21804 to u == 1 before the U_MAX clamp
    keys = torch.tensor([276830416, 0, 2**32 - 1, 12345], dtype=torch.int64, device=DEV)
    V = 30011
    got, ref = ts.noise(keys, V), gumbel_noise(keys, V)
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    if CUDA:
        assert torch.equal(got, ref)  # bit-identical: same hash, IEEE ops, libdevice logf
    else:
        assert (got - ref).abs().max().item() < 1e-5  # numpy vs torch log: ulps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(dtype):
    """A row's token does not depend on the batch around it (size, order, neighbours)."""
    B, V = (256, 151936) if CUDA else (12, 2053)
    x, temp, keys = _case(B, V, dtype, seed=3)
    tok, lp = ts.sample_unfiltered(x, temp, keys)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0)).to(DEV)
    ptok, plp = ts.sample_unfiltered(x[perm], temp[perm], keys[perm])
    assert torch.equal(ptok, tok[perm])
    assert (plp - lp[perm]).abs().max().item() < 1e-5  # other splits: another summation order
    for i in (0, 1, B - 1):  # alone (batch 1: the most splits), and among other neighbours
        t1, _ = ts.sample_unfiltered(x[i:i + 1], temp[i:i + 1], keys[i:i + 1])
        assert t1.item() == tok[i].item()
    y, _, _ = _case(B, V, dtype, seed=4)
    y[5] = x[5]
    t2, _ = ts.sample_unfiltered(y, temp, keys)
    assert t2[5].item() == tok[5].item()


@pytest.mark.parametrize("programs_per_sm", [0, 4])  # 0: one split per row (lane-level ties)
def test_greedy_ties_take_the_first_index(programs_per_sm):
    B, V, block = 4, 3 * 1024 + 5, 1024
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(1)).to(DEV)
    first = [7, 1030, 2053, 100]  # ties one and two tiles (the same lane) apart, or across lanes
    for r, i in enumerate(first):
        x[r, [i, i + block, V - 1] if i + block < V - 1 else [i, V - 1]] = 9.0
    x[3, 900] = 9.0
    tok, _ = ts.sample_unfiltered(x, torch.zeros(B, device=DEV), torch.arange(B, device=DEV),
                                  block=block, programs_per_sm=programs_per_sm)
    assert tok.tolist() == [7, 1030, 2053, 100] == x.argmax(-1).tolist()


def test_strided_logits_and_all_greedy():
    B, V = 3, 1000
    x, _, keys = _case(B, 2 * V, torch.float32)
    view = x[:, :V]  # row stride 2V
    temp = torch.zeros(B, device=DEV)
    tok, lp = ts.sample_unfiltered(view, temp, keys)
    assert torch.equal(tok, view.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(view, -1).gather(1, tok[:, None]).squeeze(1), atol=1e-5)


@pytest.mark.parametrize("use_filter", [False, True])
def test_sampler_routes_unfiltered_batches_to_triton(use_filter):
    if not CUDA:
        assert Sampler(DEV, triton=True).fast is None  # CPU keeps the torch path
        return
    B, V = 16, 5000
    x, temp, keys = _case(B, V, torch.bfloat16)
    top_p = torch.full((B,), 0.9 if use_filter else 1.0, device=DEV)
    floats = torch.stack([temp, top_p])
    ints = torch.stack([keys, torch.zeros(B, dtype=torch.int64, device=DEV)])
    tok, lp = Sampler(DEV, triton=True)(x, floats, ints, use_filter)
    ref_tok, ref_lp = sample(x, temp, ints[1], top_p, keys, use_filter)
    assert torch.equal(tok, ref_tok)
    assert (lp - ref_lp).abs().max().item() < 1e-4


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replay_matches_eager():
    B, V = 64, 151936
    x, temp, keys = _case(B, V, torch.bfloat16, seed=5)
    sx, st, sk = x.clone(), temp.clone(), keys.clone()
    ts.sample_unfiltered(sx, st, sk)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gtok, glp = ts.sample_unfiltered(sx, st, sk)
    for seed in (6, 7):
        x2, t2, k2 = _case(B, V, torch.bfloat16, seed=seed)
        sx.copy_(x2), st.copy_(t2), sk.copy_(k2)
        graph.replay()
        tok, lp = ts.sample_unfiltered(x2, t2, k2)
        assert torch.equal(gtok, tok) and torch.equal(glp, lp)


