"""The engine on Qwen3.5 (hybrid Gated DeltaNet), Qwen3-MoE and Qwen3.5-MoE vs transformers (CPU, fp32).

Each test crosses KV-block boundaries (block 4), prefill-chunk boundaries (a 7-token budget) and,
for one prompt, transformers' 64-token delta-rule chunk; forks n > 1 from one prefill (the
children's recurrent state is copied, not recomputed) and forces preemption (a small KV pool:
the state is dropped and recomputed).
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, hf_greedy_loop, make_llm, prompts_for
from families import FAMILIES, build_family, family_config

from asyncrl.types import SamplingParams


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {f: build_family(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def family_hf(family_dirs):
    from transformers import AutoModelForCausalLM

    return {f: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for f, d in family_dirs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_forks_and_preemption_matches_hf(family, family_dirs, family_hf):
    """n = 2 greedy samples per prompt share one prefill (7-token chunks); 8 blocks of 4 tokens
    for 4 sequences growing to 14-17 tokens (4-5 blocks each) force preemption; every sample
    equals HF's greedy continuation (full recompute per token)."""
    prompts = prompts_for(2, [9, 6])
    llm = make_llm(family_dirs[family], num_kv_blocks=8, max_num_batched_tokens=7)
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True))
    assert llm.metrics["preemptions"] > 0 and llm.metrics["forked_prompt_tokens"] > 0
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.completions] == [hf_greedy_loop(family_hf[family], p, 8)] * 2
    assert llm.block_manager.num_free_blocks == 8
    llm.block_manager.check_invariants([])


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_equal_hf_log_softmax(family, family_dirs, family_hf):
    """Sampled tokens' log-probs equal log_softmax(HF logits / T) of the full sequence to 1e-4,
    with forks (n = 3) and preemption under a small pool (8 blocks for 6 sequences of 3-5 blocks)."""
    T = 0.7
    prompts = prompts_for(3, [5, 11])
    llm = make_llm(family_dirs[family], num_kv_blocks=8, max_num_batched_tokens=7)
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=T, max_tokens=6, seed=11, ignore_eos=True))
    assert llm.metrics["preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert len({tuple(c.token_ids) for c in o.completions}) > 1  # the samples differ
        for c in o.completions:
            with torch.no_grad():
                logits = family_hf[family](torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / T, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert (torch.tensor(c.logprobs) - ref).abs().max().item() <= 1e-4


def test_hybrid_long_prompt_crosses_delta_rule_chunks(family_dirs, family_hf):
    """A 70-token prompt (transformers runs the delta rule in 64-token chunks) prefilled by the
    engine in 32-token pieces, each continuing the slot's conv and delta-rule state."""
    prompt = prompts_for(5, [70])[0]
    llm = make_llm(family_dirs["qwen3_5"], max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].completions[0]
    assert out.token_ids == hf_greedy(family_hf["qwen3_5"], prompt, 6)


def test_a_hybrid_without_full_attention_layers_runs(tmp_path):
    """Two Gated DeltaNet layers and no attention layer: no KV bytes per block (the pool is sized
    by tokens, not memory), greedy equal to HF's forward without a cache (HF's generate cannot run it:
    its cache asks an attention layer for the sequence length)."""
    from transformers import AutoModelForCausalLM

    config = family_config("qwen3_5")
    config.num_hidden_layers, config.layer_types = 2, ["linear_attention"] * 2
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    hf.save_pretrained(str(tmp_path))
    prompts = prompts_for(2, [3, 9])
    outs = make_llm(str(tmp_path)).generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(5):
                ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert out.completions[0].token_ids == ids[len(prompt):]


def test_qwen3_5_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """Released Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration`` (text under
    ``model.language_model.*``, a vision tower, the text numbers in ``text_config``): the engine
    loads the text part, from a directory and from the module, and matches HF's generate."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=family_config("qwen3_5").to_dict(),
                                                       vision_config=vision, tie_word_embeddings=True,
                                                       eos_token_id=3)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 if p.shape[0] == 97 else 0.15)
    hf.save_pretrained(str(tmp_path))
    prompts = prompts_for(1, [3, 9])
    params = SamplingParams(temperature=0.0, max_tokens=6)
    for source in (str(tmp_path), hf):
        outs = make_llm(source).generate(prompts, params)
        assert [o.completions[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_hybrid_state_slots_and_no_prefix_cache(family_dirs):
    """Qwen3.5: each live sequence owns the state slot of its table row; the prefix cache is off
    (a hit would skip tokens whose recurrent state nobody holds); fork copies states."""
    from asyncrl.engine.state_pool import StateSlotManager

    llm = make_llm(family_dirs["qwen3_5"], max_num_seqs=4)
    assert isinstance(llm.block_manager, StateSlotManager) and not llm.block_manager.enable_prefix_caching
    assert llm.runner.state_pool.num_slots == 5 and len(llm.block_manager.free_rows) == 5
    prompt = prompts_for(4, [9])[0]
    rid = llm.add_request(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=0, ignore_eos=True))
    llm.step()  # prefill + fork: 3 rows, the children's states copied from the parent's
    group = llm._requests[rid].group
    rows = [s.table_row for s in group]
    assert len(set(rows)) == 3
    for ssm in llm.runner.state_pool.ssm:
        assert torch.equal(ssm[rows[1]], ssm[rows[0]]) and torch.equal(ssm[rows[2]], ssm[rows[0]])
        assert ssm[rows[0]].abs().sum() > 0
    while llm.has_unfinished():
        llm.step()
    assert len(llm.block_manager.free_rows) == 5
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].completions  # reuses freed slots
    assert llm.metrics["prefix_cache_hit_tokens"] == 0


@pytest.fixture
def exact_fp32():
    """fp32 on the GPU as fp32: no TF32 in cuBLAS / cuDNN, IEEE fp32 ``tl.dot`` in Triton kernels
    (``TRITON_F32_DEFAULT``: FLA's chunked delta rule and our kernels default to TF32 for fp32
    inputs, ~1e-3 relative), and IEEE in FLA's fused triangular solve, which names TF32 itself
    (``SOLVE_TRIL_DOT_PRECISION``, a module constant of ``fla.ops.gated_delta_rule.chunk_fwd``).
    Both are read when a kernel first compiles, so they hold for kernels compiled inside this
    test (run the file in its own process); the FLA constant stays set for the process (Triton
    refuses a kernel whose constant changed after it compiled)."""
    import os

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, os.environ.get("TRITON_F32_DEFAULT"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    try:
        import triton.language as tl
        from fla.ops.gated_delta_rule import chunk_fwd
    except ImportError:  # no FLA: the torch prefill runs
        pass
    else:
        chunk_fwd.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    if saved[2] is None:
        os.environ.pop("TRITON_F32_DEFAULT")
    else:
        os.environ["TRITON_F32_DEFAULT"] = saved[2]


def _routing_mismatch(hf, outs) -> float:
    """Fraction of (token, MoE layer) pairs where HF's own top-k differs from the engine's routing."""
    from asyncrl.training.batch import build_train_batch
    from asyncrl.training.logprobs import response_logprobs
    from asyncrl.training.routing_replay import RoutingReplay

    batch = build_train_batch(outs, [0.0] * sum(len(o.completions) for o in outs), pad_id=0)
    measure = RoutingReplay(hf, replay=False)
    try:
        with torch.no_grad(), measure.use(batch.routed_experts, batch.routing_mask):
            response_logprobs(hf, batch.input_ids, batch.attention_mask, batch.prompt_length, share_prompts=False,
                              pack_bin_tokens=0)
        return measure.mismatch_rate()
    finally:
        measure.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_engine_matches_hf(family, family_dirs, family_hf, exact_fp32):
    """The engine on CUDA (fp32, TF32 off) against transformers on the CPU (fp32, its own torch
    delta rule and conv: the same reference as the CPU tests, independent of the FLA kernels the
    engine calls). Decode runs as CUDA graphs (Triton GDN step over state slots, fused-MoE grouped
    GEMM, routing written inside the graph); prefill through FLA's packed varlen kernel when
    fla-core is installed, in 32-token chunks (the 40-token prompt continues its slot's state);
    forks share the prompt; a 6-block pool forces preemption (state recomputed). Greedy tokens
    equal HF's, the routing equals HF's own top-k, sampled log-probs equal HF's log-softmax."""
    from asyncrl.engine import LLM
    from asyncrl.engine.models.gated_delta import fla_available

    prompts = prompts_for(20, [3, 17, 40, 9])
    kw = dict(dtype=torch.float32, device="cuda", block_size=16, max_num_seqs=32, max_model_len=256,
              max_num_batched_tokens=32, compile_sampler=False, return_routed_experts=True)
    llm = LLM(family_dirs[family], **kw)
    assert llm.runner.graphs
    hybrid = llm.runner.state_pool is not None
    assert llm.runner.packed_state_prefill == (hybrid and fla_available())
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.completions] == [hf_greedy_loop(family_hf[family], p, 20)] * 2
        if family != "qwen3_5":
            assert o.completions[0].routed_experts.shape[0] == len(p) + 19
    if family != "qwen3_5":
        assert _routing_mismatch(family_hf[family], outs) == 0.0
    llm.close()
    small = LLM(family_dirs[family], num_kv_blocks=6, **kw)
    sampled = small.generate(prompts, SamplingParams(n=2, temperature=0.8, max_tokens=20, seed=3, ignore_eos=True))
    assert small.metrics["preemptions"] > 0
    worst = 0.0
    for p, o in zip(prompts, sampled):
        for c in o.completions:
            with torch.no_grad():
                logits = family_hf[family](torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst <= 2e-4, f"max |engine - HF| log-prob {worst:.2e}"


def test_bf16_delta_rule_state_mismatch_is_measured(family_dirs, family_hf):
    """``mamba_ssm_cache_dtype="bfloat16"`` stores the Gated DeltaNet state in bf16 (computed in
    fp32, rounded once per step); mean |log p_engine - log p_HF fp32| over the engine's own
    samples (n = 2 forks, 16 tokens), fp32 model: fp32 state ~1e-6, bf16 state ~3e-4 (measured
    1.4e-6 and 2.7e-4; a bf16 model is ~3e-2, bench/RESULTS.md)."""
    from test_fp8_linear import mean_mismatch

    hf, prompts = family_hf["qwen3_5"], prompts_for(0, [5, 9, 7, 12])
    fp32 = make_llm(family_dirs["qwen3_5"])
    bf16 = make_llm(family_dirs["qwen3_5"], mamba_ssm_cache_dtype="bfloat16")
    assert fp32.runner.state_pool.ssm[0].dtype == torch.float32
    assert all(s.dtype == torch.bfloat16 for s in bf16.runner.state_pool.ssm)
    assert bf16.runner.state_pool.conv[0].dtype == torch.float32  # the conv state keeps the model dtype
    assert mean_mismatch(fp32, hf, prompts) < 1e-5 < mean_mismatch(bf16, hf, prompts) < 2e-3
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype='bf16'"):
        make_llm(family_dirs["qwen3_5"], mamba_ssm_cache_dtype="bf16")


def _fla_contracts(calls: list):
    """Stand-ins with the contracts of FLA's ``chunk_gated_delta_rule`` and ``causal_conv1d`` (packed
    tokens ``[1, T, ..]``, ``cu_seqlens``, per-sequence initial states in, final states out; a conv
    state of W inputs), computed per segment by transformers' torch functions; each call is logged
    with its number of sequences. FLA's real conv is checked against the torch conv in
    ``test_gated_delta.py`` (interpreter / GPU)."""
    from test_gated_delta import hf

    def segments(cu_seqlens):
        return [slice(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]

    def chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
              chunk_indices):
        calls.append(("delta_rule", len(cu_seqlens) - 1))
        outs = [hf.torch_chunk_gated_delta_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s],
                                                initial_state=initial_state[i:i + 1], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
                for i, s in enumerate(segments(cu_seqlens))]
        return torch.cat([o for o, _ in outs], 1), torch.cat([f for _, f in outs])

    def conv(x, weight, *, initial_state, output_final_state, activation, backend, cu_seqlens, chunk_indices):
        calls.append(("conv", len(cu_seqlens) - 1))
        W, ys, finals = weight.shape[1], [], []
        for i, s in enumerate(segments(cu_seqlens)):
            ext = torch.cat([initial_state[i, :, 1:].T, x[0, s]])  # [W - 1 + L, C]
            ys.append(F.silu(sum(ext[j:j + s.stop - s.start] * weight[:, j] for j in range(W))))
            finals.append(torch.cat([initial_state[i].T, x[0, s]])[-W:].T)
        return torch.cat(ys)[None], torch.stack(finals)

    return chunk, conv


def test_packed_prefill_runs_one_kernel_call_per_layer_for_the_whole_step(family_dirs, family_hf, monkeypatch):
    """The GPU prefill path (``packed_state_prefill``), run on the CPU with FLA's contracts: every
    step hands each Gated DeltaNet layer's conv and delta rule ONE call over all the step's
    sequences (``cu_seqlens``), never one per sequence; chunked prefill (32-token budget, a
    70-token prompt) and forks (n = 2) keep HF's greedy tokens. (With FLA's real conv kernel in
    place of its stand-in, under the Triton interpreter, this passed too, in 235 s: too slow to keep.)"""
    from asyncrl.engine.models import gated_delta

    calls = []
    chunk, conv = _fla_contracts(calls)
    monkeypatch.setattr(gated_delta, "_fla", lambda: chunk)
    monkeypatch.setattr(gated_delta, "_fla_conv", lambda: conv)
    prompts = prompts_for(6, [9, 70, 5])
    llm = make_llm(family_dirs["qwen3_5"], max_num_batched_tokens=32)
    llm.runner.packed_state_prefill = True  # what a GPU with fla-core sets
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.completions] == [hf_greedy_loop(family_hf["qwen3_5"], p, 5)] * 2
    gdn_layers, steps = 3, llm.metrics["steps"]
    assert [kind for kind, _ in calls].count("conv") == [kind for kind, _ in calls].count("delta_rule") \
        == gdn_layers * steps
    assert max(n for _, n in calls) > 1  # several sequences in one call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fla_conv_and_bf16_state_within_the_cpu_band(family_dirs, family_hf, exact_fp32):
    """Qwen3.5 on CUDA in exact fp32: the packed prefill (FLA's varlen conv and chunked delta rule
    when fla-core is installed; 32-token chunks, so the 40-token prompt continues its slot's
    states) and graphed decode, first with the fp32 state pool, then with a bf16 one. Mean
    |log p_engine - log p_HF| over the engine's own samples (n = 2 forks) stays near the CPU test's
    band: < 3e-5 with fp32 state (FLA's chunked sums round differently), (3e-5, 2e-3) with bf16
    (CPU: 1.4e-6 and 2.7e-4)."""
    from test_fp8_linear import mean_mismatch

    from asyncrl.engine import LLM
    from asyncrl.engine.models.gated_delta import fla_available

    hf, prompts = family_hf["qwen3_5"], prompts_for(0, [5, 9, 40, 12])
    kw = dict(dtype=torch.float32, device="cuda", block_size=16, max_num_seqs=32, max_model_len=256,
              max_num_batched_tokens=32, compile_sampler=False)
    fp32 = LLM(family_dirs["qwen3_5"], **kw)
    assert fp32.runner.graphs and fp32.runner.packed_state_prefill == fla_available()
    exact = mean_mismatch(fp32, hf, prompts)
    fp32.close()
    bf16 = LLM(family_dirs["qwen3_5"], mamba_ssm_cache_dtype="bfloat16", **kw)
    assert bf16.runner.state_pool.ssm[0].dtype == torch.bfloat16
    rounded = mean_mismatch(bf16, hf, prompts)
    bf16.close()
    assert exact < 3e-5 < rounded < 2e-3, (exact, rounded)
