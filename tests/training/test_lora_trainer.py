"""LoRA on the trainer's side (training/lora.py): PEFT adapters only in the optimizer, the
reference is the base with the adapters disabled (no copy), a sync names A and B only, merged
tensors equal PEFT's merge, and checkpoints load with ``PeftModel.from_pretrained``."""
import copy

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.training.checkpoint import save_checkpoint
from asyncrl.training.lora import (AdapterDisabledReference, adapter_tensors, apply_lora, is_lora, merged_tensors,
                                   save_merged, sync_tensors, trainable_parameters)
from asyncrl.training.reference import Reference
from asyncrl.types import TrainBatch

peft = pytest.importorskip("peft")


def lora_cfg(*overrides):
    return load_config("quickstart", ["actor.lora.rank=4", "actor.lora.alpha=8", *overrides]).actor.lora


def randomized(policy, seed=0):
    """Adapters far from PEFT's B = 0 start, as after some training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_tensors(policy):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return policy


def batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    response = torch.ones(2, 4)
    return TrainBatch(ids, mask, response, 3, torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long),
                      torch.zeros(2), torch.arange(2))


def test_only_adapters_train_and_the_reference_is_the_base_without_a_copy(tiny_policy):
    model, _ = tiny_policy
    base = copy.deepcopy(model).eval()
    policy = apply_lora(model, lora_cfg())
    assert is_lora(policy) and not is_lora(base)
    trainable = trainable_parameters(policy)
    assert trainable and {id(p) for p in trainable} == {id(p) for _, p in adapter_tensors(policy)}
    assert [n for n, _ in sync_tensors(policy)] == [n for n, _ in adapter_tensors(policy)]
    assert len(sync_tensors(base)) == len(list(base.parameters()))
    b = batch(policy.config.vocab_size)
    want = Reference(base, 1.0, 1, 4096).compute_logprobs(b)
    torch.testing.assert_close(AdapterDisabledReference(policy, 1.0, 1, 4096).compute_logprobs(b), want,
                               rtol=0, atol=0)  # fresh adapters: B = 0, the policy is the base
    randomized(policy)
    reference = AdapterDisabledReference(policy, 1.0, 1, 4096)
    assert reference.model is policy  # the same weights, not a copy
    torch.testing.assert_close(reference.compute_logprobs(b), want, rtol=0, atol=1e-6)
    assert not torch.allclose(Reference(policy, 1.0, 1, 4096).compute_logprobs(b), want, atol=1e-3)
    assert policy.training == model.training  # the reference's eval() is undone


def test_merged_tensors_equal_peft_merge_and_checkpoints_load_with_peft(tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny_policy
    base = copy.deepcopy(model).eval()
    policy = randomized(apply_lora(model, lora_cfg("actor.lora.target_modules=[q_proj,up_proj]")), seed=3).eval()
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in merged_tensors(policy):
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6)
    assert len(merged_tensors(policy)) == 2 * policy.config.num_hidden_layers
    path = save_checkpoint(tmp_path, 1, policy, tok, extra=lambda d: save_merged(policy, d / "merged", tok))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    assert not any(getattr(m, "merged", False) for m in policy.modules())  # the trainer's model stays unmerged
    ids = torch.tensor([[1, 5, 7, 3, 4, 9]])
    with torch.no_grad():
        base_logits = base(ids).logits
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
        from_merged = AutoModelForCausalLM.from_pretrained(str(path / "merged")).eval()
        torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(from_merged(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)
        assert (policy(ids).logits - base_logits).abs().max() > 1e-3


def test_bad_target_modules_name_the_key(tiny_policy):
    with pytest.raises(ConfigError, match="actor.lora.target_modules"):
        apply_lora(copy.deepcopy(tiny_policy[0]), lora_cfg("actor.lora.target_modules=[no_such_proj]"))
    with pytest.raises(ConfigError, match="target_modules is empty"):
        lora_cfg("actor.lora.target_modules=[]").validate()
