"""``engine.pdl``: programmatic dependent launch of the fused decode layer's kernels, each GEMM's weights prefetched
into L2 before it waits for the kernel before it.

PDL changes when a kernel may start, never what it computes: on a GPU the fused kernels and the engine give the same
outputs, tokens and log-probs with it on as off, bit for bit. Without a GPU: it is never used, and the kernels as
compiled for sm90 (offline, Triton's own ptxas) prefetch, then wait, then load, which is the invariant the module
states (nothing an earlier kernel writes is read before the wait).
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")  # the module's kernels are Triton's (CI installs no triton: the module skips there)

from asyncrl.engine import pdl  # noqa: E402

BENCH = pathlib.Path(__file__).parents[2] / "bench"


def test_off_the_gpu_kernels_launch_plainly(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_the_switch_turns_it_off_everywhere(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert not pdl.use_pdl(device) and pdl.launch_options(device) == {"USE_PDL": False}


def test_a_strided_weight_launches_plainly(monkeypatch):
    """The prefetch reads a program's weight rows as one contiguous range: a strided view of a weight never gets it."""
    from asyncrl.engine import triton_gemm

    monkeypatch.setattr(triton_gemm, "launch_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    weight = torch.zeros(8, 32)
    assert triton_gemm._pdl_options(weight)["USE_PDL"]
    assert triton_gemm._pdl_options(weight[:, :16]) == {"USE_PDL": False}


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(pdl.INTERPRET, reason="TRITON_INTERPRET=1 makes the kernels interpreted functions, which do not "
                    "compile; run this module without it")
def test_sm90_kernels_prefetch_their_weights_then_wait_before_any_load():
    """Each fused GEMM compiled for sm90 with ``USE_PDL``: the bulk L2 prefetch of its weights (``UBLKPF``, two
    for gate_up's gate and up rows), then the grid-dependency wait (``ACQBULK``), then its first load (TMA or
    global); without ``USE_PDL`` neither instruction is there."""
    sys.path.insert(0, str(BENCH))
    try:
        fused_layer = _bench_module("fused_layer")
        on, off = fused_layer.offline("0.6b", pdl=True), fused_layer.offline("0.6b", pdl=False)
    finally:
        sys.path.remove(str(BENCH))
    for row in on:
        first = row["first"]
        loads = [first[op] for op in ("UTMALDG", "LDG", "LDGSTS") if op in first]
        assert first["UBLKPF"] < first["ACQBULK"] < min(loads), row
        assert row["l2_prefetches"] == (2 if row["kernel"].startswith("gate_up") else 1), row
        assert "LOCAL:0" in row["usage"]
    for row in off:
        assert "UBLKPF" not in row["first"] and "ACQBULK" not in row["first"] and row["l2_prefetches"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_kernels_with_pdl_equal_without_in_a_cuda_graph(monkeypatch):
    """The fused layer chain (``bench/fused_layer.py``, bf16, Qwen3-0.6B's shapes, 4 layers, 256 rows) replayed
    from a CUDA graph: the last hidden state, the q and the K/V caches equal with PDL on and off, bit for bit."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9")
    sys.path.insert(0, str(BENCH))
    try:
        fused_layer = _bench_module("fused_layer")
    finally:
        sys.path.remove(str(BENCH))
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = fused_layer.layer_weights("0.6b", 4, g)
    step = fused_layer.Step("0.6b", 256, g)

    def replayed(on: bool):
        monkeypatch.setattr(pdl, "ENABLED", on)
        step.k_cache.zero_()
        step.v_cache.zero_()
        fused_layer.fused_chain(step, layers)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, q = fused_layer.fused_chain(step, layers)
        step.k_cache.zero_()
        step.v_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return h.clone(), q.clone(), step.k_cache.clone(), step.v_cache.clone()

    for a, b in zip(replayed(False), replayed(True)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_engine_with_pdl_equals_without(tiny_dirs, monkeypatch, dtype):
    """The engine with its layers through ``triton_gemm`` (``decoder.TRITON_GEMM``), greedy and sampled through its
    CUDA graphs: the same tokens and log-probs with PDL on as off."""
    from conftest import prompts_for

    from asyncrl.engine import LLM
    from asyncrl.engine.models import decoder
    from asyncrl.types import SamplingParams

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9")
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    prompts = prompts_for(5, [37, 50, 21])
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=0.8, max_tokens=24, seed=5, logprobs=True, ignore_eos=True)

    def run(on: bool):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.use_pdl(torch.device("cuda")) == on
        llm = LLM(tiny_dirs["qwen3"], dtype=dtype, device="cuda", block_size=16, max_num_seqs=16, max_model_len=256)
        assert llm.runner.graphs
        outs = [llm.generate(prompts, p) for p in (greedy, sampled)]
        llm.close()
        return [[(c.token_ids, c.logprobs) for c in o.completions] for out in outs for o in out]

    assert run(True) == run(False)
