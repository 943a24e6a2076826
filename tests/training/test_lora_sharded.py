"""LoRA under the FSDP2 trainer (training/lora_sharded.py, runtime/roles.py, publisher.py,
sharded_checkpoint.py) equals LoRA in one process: on 2 forked gloo ranks (one run, the
followers built on meta tensors), 3 steps with a KL term give the same losses, log-probs,
reference log-probs and adapters as one process to 1e-6 (fp32), the frozen base does not
move, a push hands the backend the same adapters (and only them; merged weights in merged
mode), the engine serves what the trainer computes (its log-probs after the push equal the
sharded trainer's), and the checkpoint written after step 2 (DCP shards of the adapters and
their optimizer state + PEFT's adapter files + merged/) resumes step 3 exactly on 2 ranks and
in one process, loads with ``PeftModel.from_pretrained`` and equals its merged export."""
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.distributed import checkpoint as sharded
from asyncrl.distributed.group import SINGLE
from asyncrl.training.actor import Actor
from asyncrl.training.lora import adapter_tensors
from tests.distributed import cases
from tests.distributed.ranks import run_ranks
from tests.training import lora_ranks

peft = pytest.importorskip("peft")
TOL = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_sharded") / "step_2"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("lora_world2")
    run_ranks(2, out, lora_ranks.rank_main, str(out), str(checkpoint))
    return torch.load(out / "lora_world2.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return lora_ranks.run(sharded=False, checkpoint=tmp_path_factory.mktemp("unused"))


def _assert_close(got: dict, want: dict, what: str, tol: float = TOL):
    assert got.keys() == want.keys() and want, what
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol * max(1.0, want[name].abs().max().item()), f"{what} {name}: max |diff| {err:.2e}"


def _same_step(got: dict, want: dict, what: str):
    for key in ("actor/pg_loss", "actor/kl_loss"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], abs=TOL), f"{what} {key}"
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=TOL), what
    for key in ("logprobs", "ref_logprobs"):
        assert (got[key] - want[key]).abs().max() <= TOL, f"{what} {key}"


def test_two_ranks_train_the_adapters_as_one_process(two_ranks, one_process):
    for index, (got, want) in enumerate(zip(two_ranks["steps"], one_process["steps"])):
        _same_step(got, want, f"step {index + 1}")
        assert want["metrics"]["actor/kl_loss"] > 1e-3  # the adapters moved the policy off its reference
    _assert_close(two_ranks["adapters"], one_process["adapters"], "adapter")
    assert all(".lora_A." in name or ".lora_B." in name for name in two_ranks["adapters"])
    moved = [(one_process["adapters"][k] - two_ranks["saved_adapters"][k]).abs().max() for k in one_process["adapters"]]
    assert min(moved) > 0  # every A and B trained (step 3 alone moved each)
    _assert_close(two_ranks["base_after"], one_process["base_before"], "base", tol=0)  # frozen, on every rank


def test_a_push_from_two_ranks_is_the_one_process_push_of_the_adapters_only(two_ranks, one_process):
    _assert_close(two_ranks["push"], one_process["push"], "pushed adapter")
    assert two_ranks["push"].keys() == two_ranks["adapters"].keys()  # A and B, nothing of the base
    adapter_bytes = sum(t.numel() * t.element_size() for t in two_ranks["adapters"].values())
    base_bytes = sum(t.numel() * t.element_size() for t in two_ranks["base_after"].values())
    assert two_ranks["push_bytes"] == one_process["push_bytes"] == adapter_bytes < 0.5 * base_bytes
    _assert_close(two_ranks["merged"], one_process["merged"], "merged weight")  # actor.lora.merged_rollout
    assert all(name.endswith("_proj.weight") and ".lora_" not in name for name in two_ranks["merged"])


def test_the_engine_serves_what_the_sharded_trainer_computes(two_ranks):
    probe = two_ranks["probe"]
    assert probe["versions"] == [lora_ranks.STEPS] * len(probe["versions"])
    assert (probe["engine"] - probe["trainer"]).abs().max() <= 1e-5


def test_the_checkpoint_resumes_on_two_ranks_and_in_one_process(two_ranks, checkpoint):
    uninterrupted = two_ranks["steps"][lora_ranks.CHECKPOINT_AFTER]
    _same_step(two_ranks["resumed"], uninterrupted, "2 ranks -> 2 ranks")
    _assert_close(two_ranks["resumed"]["adapters"], two_ranks["adapters"], "2 -> 2 adapter")
    in_one = lora_ranks.resume(checkpoint, sharded=False)
    _same_step(in_one, uninterrupted, "2 ranks -> 1 process")
    _assert_close(in_one["adapters"], two_ranks["adapters"], "2 -> 1 adapter")


def test_the_checkpoint_is_a_peft_adapter_equal_to_its_merged_export(two_ranks, checkpoint):
    from transformers import AutoModelForCausalLM

    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "dcp", "merged"} <= names
    assert "model.safetensors" not in names  # the base is not copied into every checkpoint
    adapted = peft.PeftModel.from_pretrained(cases.tiny_model(), str(checkpoint)).eval()
    loaded = {n: p.detach() for n, p in adapted.named_parameters() if ".lora_" in n}
    _assert_close(loaded, two_ranks["saved_adapters"], "saved adapter", tol=0)
    merged = AutoModelForCausalLM.from_pretrained(str(checkpoint / "merged")).eval()
    ids = torch.tensor([[1, 5, 7, 3, 4, 9, 11, 2]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)


def test_a_lora_checkpoint_is_refused_by_a_full_model_naming_the_tensor(two_ranks, checkpoint):
    cfg = load_config(None, [])
    actor = Actor(cases.tiny_model(), cfg.actor, cfg.algorithm, 1.0)
    with pytest.raises(sharded.CheckpointMismatch, match=r"'policy\.model\.\S+' .* is not in it.*actor\.lora"):
        sharded.load(checkpoint, actor.forward_module, actor.optimizer, actor.scheduler, SINGLE)


def test_one_flat_gather_cuts_uneven_shards_back_whole(two_ranks):
    gather = two_ranks["gather"]
    for whole, each, full in zip(gather["whole"], gather["each"], gather["full"]):
        assert whole.dtype == full.dtype and torch.equal(whole, full) and torch.equal(each, full)


def one_rank_bf16(device: str) -> None:
    """FSDP2 on one rank (no launcher) in bf16, as on one H200: the frozen base sharded in bf16,
    the adapters in fp32 masters with Adam moments in host memory; a step moves the adapters
    only; the push hands the bf16 engine (built before the shards) bf16 adapters, which it then
    serves (log-probs within the bf16 probe tolerance of the trainer's)."""
    from asyncrl.distributed.group import init_distributed, shutdown
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.runtime.publisher import WeightPublisher
    from asyncrl.runtime.roles import build_roles

    cfg = load_config(None, [*lora_ranks.LORA, "trainer.strategy=fsdp2", f"trainer.device={device}",
                             "model.dtype=bfloat16", "actor.offload=optimizer", "actor.gradient_checkpointing=true"])
    dp = init_distributed(cfg.trainer)
    try:
        policy = lora_ranks.lora_policy(cfg).to(device)
        policy.base_model.model.to(torch.bfloat16)  # the base as prepare_policy loads it, the adapters in fp32
        for _, param in adapter_tensors(policy):
            param.data = param.data.float()
        engine = EngineBackend(policy, None, dtype=torch.bfloat16, device=device, num_kv_blocks=16, block_size=8)
        actor, reference, _ = build_roles(cfg, policy, dp)
        dtypes = {p.dtype for p in actor.forward_module.parameters() if not p.requires_grad}
        assert dtypes == {torch.bfloat16}
        before = lora_ranks.named(actor, trainable=True)
        assert before and all(t.dtype == torch.float32 for t in before.values())
        base = lora_ranks.named(actor, trainable=False)
        metrics = lora_ranks.step(actor, reference, 0)["metrics"]
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        after = lora_ranks.named(actor, trainable=True)
        assert all(not torch.equal(before[k], after[k]) for k in before)
        assert all(torch.equal(base[k], t) for k, t in lora_ranks.named(actor, trainable=False).items())
        publisher = WeightPublisher(actor, engine, 1, torch.bfloat16)
        publisher.push(actor.version)
        assert publisher.last_bytes == sum(t.numel() * 2 for t in after.values())  # bf16, adapters only
        probe = lora_ranks.probe(actor, engine)
        assert (probe["engine"] - probe["trainer"].float().cpu()).abs().max() <= 0.1
    finally:
        shutdown(dp)


@pytest.mark.gpu
def test_one_gpu_rank_bf16_base_fp32_adapters_and_a_bf16_push():
    one_rank_bf16("cuda")
