"""LoRA through the async runtime: a push to the rollout process moves the adapters only (bytes
counted on the broadcast channel, against a full push of the same model), the child's engine
then runs the trainer's adapted model (the probe), and an async LoRA run trains, probes and
checkpoints the adapter in PEFT's format."""
import json

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.runtime.executors.process import ProcessRolloutBackend
from asyncrl.runtime.pipeline import run_training
from asyncrl.runtime.weight_sync import LogprobProbe, rollout_weights
from asyncrl.training.lora import adapter_tensors, apply_lora
from asyncrl.types import SamplingParams

peft = pytest.importorskip("peft")

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=3",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "trainer.eval_samples=0"]
LORA_ASYNC = ["runtime.mode=async", "runtime.max_staleness=1", "runtime.rollout_process=true",
              "algorithm.decoupled=true", "algorithm.rollout_correction.level=token", "actor.lora.rank=8",
              "actor.lora.alpha=16", "actor.lora.save_merged=true", "algorithm.kl_coef=0.01"]


def medium_qwen3():
    """2 layers at hidden 512: large enough that rank-8 q/v adapters are a realistic fraction
    of the weights (2r(in+out) per adapted layer against the whole model: ~0.3%)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=3, bos_token_id=1, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def push_and_probe(backend, model, version, probe):
    """One push of what a sync moves for ``model``; (bytes the channel moved, the probe's result)."""
    before = backend.bytes_moved
    backend.update_weights(rollout_weights(model, backend), version)
    return backend.bytes_moved - before, probe.check(backend, model, version)


def test_an_adapter_push_moves_under_one_percent_of_a_full_push():
    """One rollout process on the collective transport: its start broadcasts every weight (a
    full push, counted by the channel), each later push only A and B (counted the same way)."""
    model = medium_qwen3()
    cfg = load_config("quickstart", ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"])
    policy = apply_lora(model, cfg.actor.lora)
    probe = LogprobProbe([5, 17, 42, 9, 100], temperature=1.0, tolerance=1e-4)
    backend = ProcessRolloutBackend(policy, None, "engine", transport="collective")
    try:
        full_bytes = backend.bytes_moved
        assert probe.check(backend, policy, 0).gap < 1e-4  # the base arrived
        with torch.no_grad():  # the adapters a few optimizer steps would give (B starts at zero)
            for _, p in adapter_tensors(policy):
                p.copy_(0.05 * torch.randn_like(p))
        lora_bytes, lora_probe = push_and_probe(backend, policy, 1, probe)
    finally:
        backend.close()
    assert full_bytes == sum(p.numel() * 4 for p in policy.parameters())  # every weight (the base and A, B)
    # the child serves base + adapter unmerged: it follows the push (the adapter moved the log-probs)
    assert lora_probe.gap < 1e-4 and lora_probe.delta > 1e-3
    assert lora_bytes == sum(p.numel() * 4 for _, p in adapter_tensors(policy))
    assert lora_bytes < 0.01 * full_bytes, (lora_bytes, full_bytes)


def test_a_restarted_lora_child_gets_the_base_and_the_last_pushed_adapters():
    """Collective transport with restarts: pushes move A and B only, yet a child started after
    a death needs every weight; the trainer's full buffer (the frozen base + the adapters of
    the last push, not the trainer's newer ones) is broadcast to it."""
    model = medium_qwen3()
    cfg = load_config("quickstart", ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"])
    policy = apply_lora(model, cfg.actor.lora)
    probe = LogprobProbe([5, 17, 42, 9, 100], temperature=1.0, tolerance=1e-4)
    backend = ProcessRolloutBackend(policy, None, "engine", transport="collective", max_restarts=1)
    try:
        full_bytes = backend.bytes_moved
        assert probe.check(backend, policy, 0).gap < 1e-4  # the base arrived
        with torch.no_grad():
            for _, p in adapter_tensors(policy):
                p.copy_(0.05 * torch.randn_like(p))
        lora_bytes, pushed = push_and_probe(backend, policy, 1, probe)
        assert pushed.gap < 1e-4 and pushed.delta > 1e-3
        at_push = {name: p.detach().clone() for name, p in adapter_tensors(policy)}
        with torch.no_grad():  # the trainer moves on without pushing: a new child must not see this
            for _, p in adapter_tensors(policy):
                p.add_(0.05 * torch.randn_like(p))
        first = backend.process
        first.kill()
        first.join(10)
        out = backend.generate([[5, 17, 42]], SamplingParams(max_tokens=4, temperature=0.0, seed=0))
        assert backend.restarts == 1 and backend.process is not first and backend.version == 1
        assert len(out[0].outputs[0].token_ids) == 4
        assert backend.bytes_moved == 2 * full_bytes + lora_bytes  # the whole set again, once, for the new child
        with torch.no_grad():  # the trainer's model back at the pushed adapters: the new child serves exactly them
            for name, p in adapter_tensors(policy):
                p.copy_(at_push[name])
        assert probe.check(backend, policy, 1).gap < 1e-4
    finally:
        backend.close()


def test_an_async_lora_run_with_the_rollout_process(cfg_of, tmp_path):
    """The rollout process shares the frozen base and receives the adapters; the reference is
    the base (KL loss on); the checkpoint is a PEFT adapter that ``PeftModel.from_pretrained``
    loads onto the base, equal to the merged model saved beside it. (Three steps of the tiny
    task may leave B at zero — no reward signal yet — so that the saved adapter is a trained,
    non-zero one is shown by tests/training/test_lora_trainer.py.)"""
    from transformers import AutoModelForCausalLM

    from asyncrl.data.tasks import build_task
    from asyncrl.runtime.pipeline import prepare_policy

    cfg = cfg_of(*LORA_ASYNC)
    summary = run_training(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and all(r["async/staleness_violations"] == 0 for r in rows)
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in rows[1:])
    base = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)[0].eval()
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert all(0 < r["weight_sync/bytes"] < 0.5 * full_bytes for r in rows if "weight_sync/bytes" in r)
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in ckpt.iterdir()}
    ids = torch.tensor([[1, 5, 7, 3, 4, 9, 11, 2]])
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, str(ckpt)).eval()
        merged = AutoModelForCausalLM.from_pretrained(str(ckpt / "merged")).eval()
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)


def test_an_adapter_push_to_a_bf16_engine_sends_bf16_and_the_merged_path_stays_exact():
    """PEFT keeps A and B in fp32 under a bf16 base: a push casts them to the engine's dtype on
    the sender (half the bytes of fp32, and the engine's slots then hold what it got); an fp32
    engine gets the trainer's own tensors (nothing cast); a merged engine gets W + s·B·A
    computed from the fp32 adapters, exactly as before."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncrl.rollout.engine_backend import EngineBackend

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
                      eos_token_id=3, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    lora_cfg = load_config("quickstart", ["actor.lora.rank=4", "actor.lora.alpha=12"]).actor.lora  # scale 3: not a power of 2
    policy = apply_lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), lora_cfg)
    with torch.no_grad():
        for _, p in adapter_tensors(policy):
            p.copy_(0.05 * torch.randn_like(p))
    adapters = dict(adapter_tensors(policy))
    assert {p.dtype for p in adapters.values()} == {torch.float32}  # PEFT's choice, what the optimizer updates
    engine = EngineBackend(policy, None, dtype=torch.bfloat16, device="cpu", num_kv_blocks=16, block_size=8)
    pushed = rollout_weights(policy, engine)
    assert {name for name, _ in pushed} == set(adapters)
    assert {t.dtype for _, t in pushed} == {torch.bfloat16}
    assert sum(t.numel() * t.element_size() for _, t in pushed) * 2 == sum(p.numel() * 4 for p in adapters.values())
    for name, tensor in pushed:  # the values are the fp32 adapters rounded once
        assert torch.equal(tensor, adapters[name].to(torch.bfloat16))
    engine.update_weights(pushed, 1)
    layer, shard = engine.llm.lora.slots["model.layers.0.self_attn.q_proj"]
    a = adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert torch.equal(layer.lora_a[:4], a.to(torch.bfloat16))  # the slot holds exactly what was pushed

    fp32_policy = apply_lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), lora_cfg)
    fp32_engine = EngineBackend(fp32_policy, None, dtype=torch.float32, device="cpu", num_kv_blocks=16, block_size=8)
    assert [(n, t.data_ptr()) for n, t in rollout_weights(fp32_policy, fp32_engine)] == \
        [(n, p.data_ptr()) for n, p in adapter_tensors(fp32_policy)]  # the trainer's own storages, no copy

    merged_engine = EngineBackend(policy, None, dtype=torch.bfloat16, device="cpu", num_kv_blocks=16, block_size=8,
                                  merge_lora=True)
    merged = dict(rollout_weights(policy, merged_engine))
    base = policy.base_model.model.model.layers[1].mlp.down_proj
    a, b = base.lora_A["default"].weight, base.lora_B["default"].weight
    expected = (base.base_layer.weight.float() + 3.0 * (b.float() @ a.float())).to(torch.bfloat16)
    assert torch.equal(merged["model.layers.1.mlp.down_proj.weight"], expected)
