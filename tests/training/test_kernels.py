"""actor.kernels: the choice per machine and architecture, and Liger's modules put into a built
model by class swap (names, deepcopy, hooks and the CPU path unchanged). Liger's Triton kernels
themselves run only on a GPU (the interpreter cannot run them): the gpu-marked test compares them
with HF's modules there."""
import copy
import importlib
import pickle

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.training import kernels
from asyncrl.training.forward_plan import plan_of, prepare_model


def _model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
    return Qwen3ForCausalLM(Qwen3Config(**{**config, **overrides}))


def test_auto_is_eager_on_cpu_and_liger_refuses_with_the_reason():
    model = _model()
    assert kernels.resolve_kernels("auto", model) == "eager"
    assert kernels.resolve_kernels("eager", model) == "eager"
    with pytest.raises(ValueError, match="actor.kernels=liger: .*CUDA"):
        kernels.resolve_kernels("liger", model)
    with pytest.raises(ValueError, match="actor.kernels must be one of"):
        kernels.resolve_kernels("fast", model)


def test_an_unlisted_architecture_is_never_patched():
    model = _model()
    model.config.model_type = "qwen3_5_text"  # x * (1 + w) norms: Liger's llama norm would be wrong
    assert "is not one of" in kernels.liger_unsupported_reason(model)


def _hook(*args):
    return None


def test_class_swap_keeps_names_hooks_deepcopy_and_the_cpu_numbers():
    """apply_liger on a CPU model: RMSNorms (incl. q/k norms) and MLPs get Liger subclasses; the
    parameter names and a forward hook survive; a deep copy keeps the classes; RoPE on CPU
    tensors still runs HF's function, so the outputs of the attention path are unchanged."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    model.model.layers[0].mlp.register_forward_hook(_hook)  # e.g. routing replay's hooks
    swapped = kernels.apply_liger(model)
    assert swapped == 2 * (2 + 2 + 1) + 1  # per layer: 2 norms, q/k norms, the MLP; the final norm
    assert [n for n, _ in model.named_parameters()] == names
    layer = model.model.layers[0]
    assert type(layer.mlp).__name__ == "LigerQwen3MLP" and isinstance(layer.mlp, type(_model().model.layers[0].mlp))
    clone = copy.deepcopy(model)
    assert type(clone.model.norm).__name__ == "LigerQwen3RMSNorm"
    assert clone.model.norm.weight is not model.model.norm.weight
    torch.testing.assert_close(clone.model.norm.weight, model.model.norm.weight)
    # pickled to another process (the rollout's) as HF's own classes, weights included
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored.model.norm) is type(_model().model.norm)
    torch.testing.assert_close(restored.lm_head.weight, model.lm_head.weight)
    modeling = importlib.import_module(kernels.LIGER_ARCHITECTURES["qwen3"])
    q, k = torch.randn(2, 1, 4, 3, 8).unbind(0)
    cos, sin = torch.randn(2, 1, 3, 8).unbind(0)
    with kernels.liger_rope_enabled():
        ours = modeling.apply_rotary_pos_emb(q, k, cos, sin)  # CPU tensors: HF's function
    expected = (q * cos[:, None] + torch.cat([-q[..., 4:], q[..., :4]], -1) * sin[:, None])
    torch.testing.assert_close(ours[0], expected)
    assert len(layer.mlp._forward_hooks) == 1  # a hook registered before the swap stays (it fires on GPU)


def test_prepare_model_on_cpu_resolves_the_cpu_defaults():
    model = _model()
    plan = prepare_model(model)
    assert (plan.body, plan.head, plan.layout) == ("eager", "torch", "tree")
    assert plan_of(model) is plan
    with pytest.raises(ValueError, match="actor.packing must be one of"):
        prepare_model(model, packing="flat")


@pytest.mark.gpu
def test_liger_matches_hf_modules_on_gpu():
    """bf16 on CUDA: the Liger model's log-probs and gradients are HF's to bf16 rounding."""
    from asyncrl.training.logprobs import response_logprobs

    if not kernels.liger_available():
        pytest.skip("liger-kernel not installed")
    eager = _model(vocab_size=1000, hidden_size=128, intermediate_size=256, head_dim=32).cuda().bfloat16()
    liger = copy.deepcopy(eager)
    prepare_model(eager, "eager", "varlen")
    assert prepare_model(liger, "liger", "varlen").body == "liger"
    ids = torch.randint(1, 1000, (6, 40), device="cuda")
    mask = torch.ones_like(ids)
    outs = []
    for model in (eager, liger):
        lp, ent = response_logprobs(model, ids, mask, 24, 0.9, with_entropy=True)
        (lp.sum() - 0.01 * ent.sum()).backward()
        outs.append((lp.float(), [p.grad.float() for p in model.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0.05, rtol=0.05)
    for a, b in zip(outs[0][1], outs[1][1]):
        assert float((a - b).norm() / b.norm().clamp(min=1e-6)) < 0.05
