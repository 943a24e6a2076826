"""Our model implementations vs HF transformers on tiny random checkpoints (fp32)."""
import pytest
import torch
from conftest import build_tiny, make_llm  # at import: a lazy import would get another dir's conftest

from asyncrl.engine.attention import build_gathered_metadata
from asyncrl.engine.models import load_model

ARCHS = ["qwen3", "qwen2", "llama"]


def _alloc_cache(model, num_blocks, block_size):
    c = model.config
    for layer in model.model.layers:
        shape = (num_blocks + 1, block_size, c.num_key_value_heads, c.head_dim)
        layer.self_attn.k_cache = torch.zeros(shape)
        layer.self_attn.v_cache = torch.zeros(shape)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_hf(arch, tiny_dirs, hf_models):
    """Packed prefill of 3 prompts of different lengths, then a chunked continuation:
    every position's logits equal HF's within 1e-4."""
    model = load_model(tiny_dirs[arch], dtype=torch.float32)
    bs, nb = 4, 32
    _alloc_cache(model, nb, bs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 97, (n,), generator=g).tolist() for n in (11, 5, 16)]
    tables = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    # step 1: first 7/5/9 tokens; step 2: the rest (chunked prefill over the cache)
    cuts = [7, 5, 9]
    logits = [[] for _ in prompts]
    for step in range(2):
        starts = [0 if step == 0 else c for c in cuts]
        ns = [c if step == 0 else len(p) - c for p, c in zip(prompts, cuts)]
        live = [i for i, n in enumerate(ns) if n > 0]
        meta = build_gathered_metadata([tables[i] for i in live], [starts[i] for i in live],
                                       [ns[i] for i in live], bs, nb, torch.device("cpu"))
        ids = torch.tensor(sum([prompts[i][starts[i]:starts[i] + ns[i]] for i in live], []))
        pos = torch.tensor(sum([list(range(starts[i], starts[i] + ns[i])) for i in live], []))
        with torch.no_grad():
            out = model.compute_logits(model(ids, pos, meta))
        o = 0
        for i in live:
            logits[i].append(out[o:o + ns[i]])
            o += ns[i]
    for p, chunks in zip(prompts, logits):
        ours = torch.cat(chunks)
        with torch.no_grad():
            ref = hf_models[arch](torch.tensor([p])).logits[0].float()
        assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_load_weights_roundtrip(arch, tiny_dirs, hf_models):
    """update path: HF state_dict names load into fused params and reproduce HF's weights."""
    model = load_model(tiny_dirs[arch], dtype=torch.float32)
    hf = hf_models[arch]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_weights(hf.state_dict().items())
    sd = hf.state_dict()
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight[: q.shape[0]], q)
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    with pytest.raises(KeyError):
        model.load_weights([("model.layers.0.self_attn.nope.weight", q)])


def test_in_memory_model_stops_at_the_same_eos_list_as_its_directory(tmp_path):
    """generation_config.json's EOS list (Qwen instruct: <|im_end|> and <|endoftext|>) wins over
    config.json's single id, for an engine built from the directory and from the loaded module."""
    from transformers import AutoModelForCausalLM, GenerationConfig


    path = build_tiny("qwen3", tmp_path / "m")  # config.json: eos_token_id = 3
    GenerationConfig(eos_token_id=[3, 5]).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert make_llm(path).eos_token_ids == [3, 5]
    assert make_llm(hf).eos_token_ids == [3, 5]  # was [3]: the module's generation_config was ignored


def test_fused_gemms_default_to_hopper_with_folded_norms(monkeypatch):
    """``decoder.TRITON_GEMM = None`` (the default) turns the fused decode GEMMs on only where they were measured
    faster: CUDA compute capability 9.x with ``FOLD_NORMS``; True forces them on any CUDA device, False turns them
    off; a CPU never takes them outside the Triton interpreter."""
    from asyncrl.engine.models import decoder

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(decoder, "_INTERPRET", False)
    assert decoder.TRITON_GEMM is None and decoder.FOLD_NORMS
    assert decoder.fused_gemms_enabled(cuda) and not decoder.fused_gemms_enabled(cpu)
    capability[0] = (8, 0)
    assert not decoder.fused_gemms_enabled(cuda)
    monkeypatch.setattr(decoder, "TRITON_GEMM", True)
    assert decoder.fused_gemms_enabled(cuda) and not decoder.fused_gemms_enabled(cpu)
    monkeypatch.setattr(decoder, "_INTERPRET", True)
    assert decoder.fused_gemms_enabled(cpu)
    monkeypatch.setattr(decoder, "TRITON_GEMM", None)
    capability[0] = (9, 0)
    monkeypatch.setattr(decoder, "FOLD_NORMS", False)
    assert not decoder.fused_gemms_enabled(cuda)
    monkeypatch.setattr(decoder, "TRITON_GEMM", False)
    monkeypatch.setattr(decoder, "FOLD_NORMS", True)
    assert not decoder.fused_gemms_enabled(cuda)
