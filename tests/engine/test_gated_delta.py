"""Gated DeltaNet ops over state slots vs transformers' own torch functions (the oracle).

transformers' ``torch_chunk_gated_delta_rule`` (chunked, what HF prefill runs without FLA) and
``torch_recurrent_gated_delta_rule`` (decode), ``causal_conv1d_fn`` / ``causal_conv1d_update``.
Our ops take padded variable-length batches and read/write slots of a state pool. Inputs are
fp64; both sides compute the delta rule in fp32 (transformers casts to it), so they agree to fp32
rounding (chunked vs recurrent summation order); the conv stays fp64 on both sides.
"""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from asyncrl.engine.models.gated_delta import causal_conv_step, causal_conv_varlen, gated_delta_decode, \
    gated_delta_prefill
from asyncrl.training.hf_kernels import torch_reference

# transformers' torch functions themselves (not the FLA kernels it routes to when fla-core is installed)
hf = SimpleNamespace(**{name: torch_reference(getattr(modeling_qwen3_5, name)) for name in (
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")})

B, HK, HV, K, V, C, W = 3, 2, 4, 8, 6, 10, 4


def _inputs(L, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return (r(B, L, HK, K), r(B, L, HK, K), r(B, L, HV, V), -torch.rand(B, L, HV, generator=g, dtype=torch.float64),
            torch.rand(B, L, HV, generator=g, dtype=torch.float64))


def test_prefill_then_decode_equal_transformers_chunked_and_recurrent():
    """Three sequences of lengths 70 / 5 / 33 padded to 70 in one call (slots 4, 0, 2), the first
    continuing a non-zero state: outputs and final states equal HF's chunked rule per sequence
    (64-token chunks: 70 crosses one); then one decode step equals HF's recurrent rule."""
    q, k, v, g, beta = _inputs(70, 0)
    lens = torch.tensor([70, 5, 33])
    valid = torch.arange(70)[None, :] < lens[:, None]
    slots, init = torch.tensor([4, 0, 2]), torch.tensor([1, 0, 0])
    pool = torch.zeros(6, HV, K, V, dtype=torch.float64)
    pool[4] = torch.randn(HV, K, V, dtype=torch.float64)
    pool[0] = 5.0  # garbage left by a previous owner: init = 0 must ignore it
    start = pool[slots].clone() * init[:, None, None, None]
    out = gated_delta_prefill(q, k, v, g, beta, valid, pool, slots, init)
    for b in range(B):
        n = int(lens[b])
        ref, final = hf.torch_chunk_gated_delta_rule(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n],
                                                     beta[b:b + 1, :n], initial_state=start[b:b + 1],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[b, :n].double(), ref[0].double(), rtol=0, atol=2e-5)
        torch.testing.assert_close(pool[slots[b]], final[0].double(), rtol=0, atol=2e-5)
    q1, k1, v1, g1, beta1 = (t[:, 0] for t in _inputs(1, 1))
    before = pool[slots].clone()
    o1 = gated_delta_decode(q1, k1, v1, g1, beta1, pool, slots)
    ref, final = hf.torch_recurrent_gated_delta_rule(q1[:, None], k1[:, None], v1[:, None], g1[:, None], beta1[:, None],
                                                     initial_state=before, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o1.double(), ref[:, 0].double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(pool[slots], final.double(), rtol=0, atol=1e-6)


def test_conv_prefill_chunks_and_decode_equal_transformers():
    """A sequence prefilled in two pieces (3 then 6 tokens: shorter than the kernel first) and
    decoded one token, next to another of 9 tokens in one piece: each equals HF's conv of the
    whole sequence; the slot holds the last W - 1 inputs."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)  # [2, 10, C]
    pool = torch.full((3, C, W - 1), 7.0, dtype=torch.float64)
    slots = torch.tensor([1, 2])
    a = causal_conv_varlen(x[:, :3], torch.tensor([3, 3]), pool, slots, torch.tensor([0, 0]), w)
    pad = torch.cat([x[:, 3:9], torch.zeros(2, 0, C, dtype=torch.float64)], 1)
    b = causal_conv_varlen(pad, torch.tensor([6, 6]), pool, slots, torch.tensor([1, 1]), w)
    torch.testing.assert_close(torch.cat([a, b], 1), ref[:, :9], rtol=0, atol=1e-12)
    torch.testing.assert_close(pool[slots], x[:, 6:9].transpose(1, 2), rtol=0, atol=0)
    # varlen: row 0 has 4 real tokens of 6 (the rest padding): its state ends at token 4
    pool2 = torch.zeros(3, C, W - 1, dtype=torch.float64)
    out = causal_conv_varlen(x[:, :6], torch.tensor([4, 6]), pool2, slots, torch.tensor([0, 0]), w)
    torch.testing.assert_close(out[0, :4], ref[0, :4], rtol=0, atol=1e-12)
    torch.testing.assert_close(pool2[1], x[0, 1:4].T, rtol=0, atol=0)
    step = causal_conv_step(x[:, 9], pool, slots, w)
    torch.testing.assert_close(step, ref[:, 9], rtol=0, atol=1e-12)
    state = torch.cat([torch.zeros(2, C, 1, dtype=torch.float64), x[:, 6:9].transpose(1, 2)], -1)
    hf_step = hf.causal_conv1d_update(x[:, 9, :, None], state, w, activation="silu")[..., 0]
    torch.testing.assert_close(step, hf_step, rtol=0, atol=1e-12)


def test_conv_step_matches_conv1d_reference():
    """Decode conv == F.conv1d over the window (sanity of the weight orientation)."""
    x = torch.randn(2, W, C, dtype=torch.float64)
    w = torch.randn(C, W, dtype=torch.float64)
    pool = x[:, :W - 1].transpose(1, 2).clone()
    out = causal_conv_step(x[:, -1], pool, torch.tensor([0, 1]), w)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], groups=C))[..., -1]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_fla_chunk_indices_list_every_64_token_chunk():
    """Lengths 64, 1, 130 -> 1, 1 and 3 chunks: (sequence, chunk) rows as FLA's prepare_chunk_indices."""
    from asyncrl.engine.models.gated_delta import fla_chunk_indices

    assert fla_chunk_indices(np.array([64, 1, 130])).tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]]


def test_fla_packed_prefill_against_the_padded_path(monkeypatch):
    """The GPU prefill hands FLA's ``chunk_gated_delta_rule`` the step's packed tokens with
    ``cu_seqlens`` and host-built chunk indices. With FLA's contract played by transformers' torch
    function per segment, the packed path (initial states from slots, final states back) equals
    the padded CPU path."""
    from asyncrl.engine.models import gated_delta

    def fake_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 chunk_indices):
        assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1 and scale == q.shape[-1] ** -0.5
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).numpy()
        assert torch.equal(chunk_indices, torch.from_numpy(gated_delta.fla_chunk_indices(lens)))
        # FLA takes Hk < HV heads as they are; transformers' torch function does only since ~5.2x
        # (older ones, as on the GPU machine, need q and k repeated to HV heads first).
        q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
        outs, finals = [], []
        for i in range(len(cu_seqlens) - 1):
            s = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
            o, f = hf.torch_chunk_gated_delta_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s],
                                                   initial_state=initial_state[i:i + 1], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    monkeypatch.setattr(gated_delta, "_fla", lambda: fake_fla)
    q, k, v, g, beta = (t.float() for t in _inputs(70, 3))
    lens = np.array([70, 4, 9])
    valid = torch.arange(70)[None, :] < torch.from_numpy(lens)[:, None]
    slots, init = torch.tensor([2, 0, 1]), torch.tensor([0, 1, 1])
    pool_a = torch.randn(3, HV, K, V)
    pool_b = pool_a.clone()
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]))
    packed = gated_delta.gated_delta_prefill_packed(q[valid], k[valid], v[valid], g[valid], beta[valid], cu,
                                                    torch.from_numpy(gated_delta.fla_chunk_indices(lens)), pool_a,
                                                    slots, init)
    padded = gated_delta_prefill(q, k, v, g, beta, valid, pool_b, slots, init)
    torch.testing.assert_close(packed.float(), padded[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(pool_a, pool_b, rtol=0, atol=2e-5)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _one_config_each(module, monkeypatch):
    """Triton's autotuner benchmarks its candidates on a GPU driver, which the interpreter has
    none of: under ``TRITON_INTERPRET=1`` give each autotuned kernel of ``module`` its first config."""
    import triton

    for name in dir(module):
        kernel = getattr(module, name)
        while hasattr(kernel, "fn"):  # heuristics -> autotuner -> jit function
            if isinstance(kernel, triton.runtime.Autotuner):
                monkeypatch.setattr(kernel, "configs", kernel.configs[:1])
            kernel = kernel.fn


NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(NO_CUDA, reason="needs CUDA")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU: needs TRITON_INTERPRET=1")),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_packed_conv_equals_the_padded_torch_conv(device, dtype, monkeypatch):
    """The GPU prefill's conv, fla-core's varlen ``causal_conv1d`` over packed tokens (a row-strided
    view, as the model's in_proj split gives it), equals the torch conv over the padded batch:
    lengths 70 / 2 / 9 in slots 4 / 0 / 2 (70 crosses FLA's 64-token chunk; 2 < W - 1, so the
    new state keeps one of the slot's old inputs), the first two continuing their slots' states,
    the third from zeros over a slot holding garbage. Outputs and states to fp32 rounding (bf16:
    one ulp; triton 3.6's interpreter truncates where the GPU rounds)."""
    ops = pytest.importorskip("fla.modules.causal_conv1d.ops")
    from asyncrl.engine.models.gated_delta import causal_conv_packed, fla_chunk_indices

    if device == "cpu":
        _one_config_each(ops, monkeypatch)
    g = torch.Generator().manual_seed(4)
    lens = np.array([70, 2, 9])
    x = torch.randn(int(lens.sum()), C + 6, generator=g)[:, :C].to(device, dtype)  # row stride C + 6
    w = torch.randn(C, W, generator=g).to(device, dtype)
    pool = torch.randn(6, C, W - 1, generator=g).to(device, dtype)
    pool_ref = pool.clone()
    slots, init = torch.tensor([4, 0, 2], device=device), torch.tensor([1, 1, 0], device=device)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).to(device)
    out = causal_conv_packed(x, cu, torch.from_numpy(fla_chunk_indices(lens)).to(device), pool, slots, init, w)
    L = int(lens.max())
    index = torch.full((3, L), x.shape[0], dtype=torch.long)  # pad rows read a zero row
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens.tolist())):
        index[b, :n] = torch.arange(a, a + n)
    padded = torch.cat([x, x.new_zeros(1, C)])[index.to(device)]
    ref = causal_conv_varlen(padded, torch.from_numpy(lens).to(device), pool_ref, slots, init, w)
    valid = torch.arange(L)[None, :] < torch.from_numpy(lens)[:, None]
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(out.float().cpu(), ref[valid.to(device)].float().cpu(), **tol)
    torch.testing.assert_close(pool.float().cpu(), pool_ref.float().cpu(), rtol=0, atol=0)
