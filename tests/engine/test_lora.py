"""The engine serving a LoRA adapter without merging it (engine/lora.py), against the merged model
and against PEFT's own forward (CPU, fp32).

The adapters are random and far from zero (PEFT starts B at zero, which would hide any mistake):
they move the log-probs by ~1 nat, so an unapplied shard, a wrong scale or a transposed block
shows. The base checkpoints are drawn at std 0.08, less peaked than conftest's (whose fp32
rounding alone, PEFT's unmerged forward against its merged one, reaches 1e-5 nats); here that
floor is ~2e-6.
"""
import pytest
import torch
from conftest import _make, make_llm, prompts_for

from asyncrl.engine.lora import LoRALinear, parse_lora_name
from asyncrl.types import SamplingParams

peft = pytest.importorskip("peft")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Qwen3 (tied head, q/k norm), Qwen2 (q/k/v bias), Llama checkpoints, weights ~ N(0, 0.08)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for seed, arch in enumerate(("qwen3", "qwen2", "llama")):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_make(arch), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.08)
                elif arch == "qwen2" and p.numel() != 64:
                    p.normal_(0, 0.05)  # non-zero q/k/v biases
        dirs[arch] = str(tmp_path_factory.mktemp(f"lora-{arch}"))
        model.save_pretrained(dirs[arch])
    return dirs


def lora_model(hf_dir, targets=ALL_LINEAR, rank=4, alpha=8.0, seed=0, rslora=False):
    """A PEFT LoRA model on the tiny checkpoint, every A and B random."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      use_rslora=rslora, task_type="CAUSAL_LM"))
    randomize_adapters(model, seed)
    return model.eval()


def randomize_adapters(model, seed, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if parse_lora_name(name) is not None:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def merged_copy(model):
    import copy

    return copy.deepcopy(model).merge_and_unload().eval()


def peft_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of ``tokens`` after ``prompt`` under ``model`` (PEFT's forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


SAMPLED = SamplingParams(n=3, temperature=0.8, max_tokens=10, seed=7, ignore_eos=True, logprobs=True)


def completions(llm, prompts, params=SAMPLED):
    return [c for out in llm.generate(prompts, params) for c in out.completions]


@pytest.mark.parametrize("targets", [ALL_LINEAR, ["q_proj", "v_proj"], ["k_proj", "up_proj", "down_proj"]])
def test_unmerged_adapter_logprobs_equal_the_merged_model(tiny_dirs, targets):
    """The must-show: the same tokens and log-probs (fp32, 1e-5) with the adapter applied on the
    fly as with it merged into the weights, for full and partial coverage of the fused q|k|v and
    gate|up layers (a partial one leaves the other shards' rows of the block-diagonal B zero)."""
    model = lora_model(tiny_dirs["qwen3"], targets)
    prompts = prompts_for(4, [5, 9, 3])
    unmerged = make_llm(model)
    assert unmerged.lora is not None and any(isinstance(m, LoRALinear) for m in unmerged.model.modules())
    merged = make_llm(merged_copy(model))
    got, want = completions(unmerged, prompts), completions(merged, prompts)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    # and both are PEFT's forward: the engine's adapter is the trainer's adapter
    for prompt, c in zip([p for p in prompts for _ in range(3)], got):
        torch.testing.assert_close(torch.tensor(c.logprobs), peft_logprobs(model, prompt, c.token_ids, 0.8),
                                   rtol=0, atol=1e-4)


def test_the_adapter_moves_the_logprobs(tiny_dirs):
    """Guards the test above: the adapter is big enough that serving the base alone fails it."""
    model = lora_model(tiny_dirs["qwen3"])
    prompts = prompts_for(4, [5, 9])
    with_adapter = completions(make_llm(model), prompts)
    with model.disable_adapter():
        gaps = [float((torch.tensor(c.logprobs) - peft_logprobs(model, p, c.token_ids, 0.8)).abs().max())
                for p, c in zip([p for p in prompts for _ in range(3)], with_adapter)]
    assert max(gaps) > 0.3
    assert make_llm(tiny_dirs["qwen3"]).lora is None  # a plain checkpoint: no slots


def test_merged_mode_and_rslora_scale(tiny_dirs):
    """``merge_lora=True`` serves W + s·B·A with plain linears; rsLoRA's s = alpha/sqrt(r) is read off
    the layers (rank 8 makes it differ from alpha/r by 2.8x)."""
    model = lora_model(tiny_dirs["llama"], rank=8, alpha=4.0, rslora=True)
    prompts = prompts_for(5, [6, 4])
    merged_engine = make_llm(model, merge_lora=True)
    assert merged_engine.lora is None and merged_engine.merged_lora
    assert not any(isinstance(m, LoRALinear) for m in merged_engine.model.modules())
    for prompt, c in zip([p for p in prompts for _ in range(3)], completions(merged_engine, prompts)):
        torch.testing.assert_close(torch.tensor(c.logprobs), peft_logprobs(model, prompt, c.token_ids, 0.8),
                                   rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="merged"):
        merged_engine.update_weights([(n, p) for n, p in model.named_parameters() if ".lora_" in n], 1)


def test_update_weights_moves_only_the_adapter_and_keeps_the_storages(tiny_dirs):
    """An update of A and B alone lands in the slots in place (what CUDA graphs captured keep
    reading) and the engine then equals the new merged model; base weights are untouched."""
    model = lora_model(tiny_dirs["qwen2"], seed=1)
    llm = make_llm(model)
    layers = [m for m in llm.model.modules() if isinstance(m, LoRALinear)]
    storages = [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in layers]
    weights = {n: p.clone() for n, p in llm.model.named_parameters()}
    randomize_adapters(model, seed=2)
    adapter = [(n, p) for n, p in model.named_parameters() if parse_lora_name(n) is not None]
    llm.update_weights(adapter, version=1)
    assert storages == [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in layers]
    assert all(torch.equal(p, weights[n]) for n, p in llm.model.named_parameters())
    prompts = prompts_for(6, [7, 3])
    for a, b in zip(completions(llm, prompts), completions(make_llm(merged_copy(model)), prompts)):
        assert a.token_ids == b.token_ids and set(a.versions) == {1}
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_an_adapter_directory_serves_on_a_base_checkpoint(tiny_dirs, tmp_path):
    """``LLM(base_dir, lora=adapter_dir)``: PEFT's saved format (names without the adapter name)."""
    model = lora_model(tiny_dirs["qwen3"], ["q_proj", "o_proj", "down_proj"], seed=3)
    model.save_pretrained(str(tmp_path))
    prompts = prompts_for(7, [5])
    from_dir = completions(make_llm(tiny_dirs["qwen3"], lora=str(tmp_path)), prompts)
    for a, b in zip(from_dir, completions(make_llm(model), prompts)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)


def test_bad_adapter_input_is_refused_with_the_cause(tiny_dirs, tmp_path):
    llm = make_llm(tiny_dirs["qwen3"])
    a = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="without a LoRA adapter"):
        llm.update_weights([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", a)], 1)
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        make_llm(tiny_dirs["qwen3"], lora=str(tmp_path))
    served = make_llm(lora_model(tiny_dirs["qwen3"], ["q_proj"]))
    with pytest.raises(KeyError, match="no adapter for model.layers.0.mlp.up_proj"):
        served.update_weights([("model.layers.0.mlp.up_proj.lora_A.weight", a)], 1)
    with pytest.raises(ValueError, match="rank"):
        served.update_weights([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64))], 1)


def test_parse_lora_name_reads_module_and_factor():
    assert parse_lora_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.default.weight") == \
        ("model.layers.3.mlp.up_proj", "B")
    assert parse_lora_name("base_model.model.model.layers.3.mlp.up_proj.lora_A.weight") == \
        ("model.layers.3.mlp.up_proj", "A")
    assert parse_lora_name("model.layers.3.mlp.up_proj.base_layer.weight") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_reads_adapter_updates(tiny_dirs):
    """GPU, fp32, CUDA graphs on: the captured decode reads the adapter slots, so after an update
    of A and B (written in place, no re-capture) the engine equals the new merged model."""
    from asyncrl.engine import LLM

    def gpu_llm(model):
        return LLM(model, dtype=torch.float32, device="cuda", block_size=16, max_num_seqs=16, num_kv_blocks=64)

    model = lora_model(tiny_dirs["qwen3"], seed=4)
    llm = gpu_llm(model)
    assert not llm.config.enforce_eager
    prompts = prompts_for(8, [5, 9, 3])
    for version, seed in ((0, None), (1, 5)):
        if seed is not None:
            randomize_adapters(model, seed)
            llm.update_weights([(n, p) for n, p in model.named_parameters() if parse_lora_name(n)], version)
        want = completions(gpu_llm(merged_copy(model)), prompts)
        for a, b in zip(completions(llm, prompts), want):
            assert a.token_ids == b.token_ids and set(a.versions) == {version}
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
