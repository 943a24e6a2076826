"""The sharded trainer on a single rank, as bench/fsdp_step.py runs it on one H200 (world size 1,
started without a launcher): fp32 master shards with compute in ``model.dtype``, activation
checkpointing, Adam moments in host memory; the weight stream yields compute-dtype tensors
equal to the master weights cast. On the CPU in fp32 the step equals the unsharded one; on a GPU
(``gpu`` marker) the bf16 step runs and moves the weights."""
import pytest
import torch
import torch.distributed as dist

from asyncrl.distributed.group import shutdown
from asyncrl.distributed.weights import full_tensors
from tests.distributed import cases

OPTIONS = ["actor.offload=optimizer", "actor.gradient_checkpointing=true", "actor.micro_batch_size=4"]


def _one_rank(device: str, dtype: str):
    from asyncrl.config import load_config
    from asyncrl.distributed.group import init_distributed
    from asyncrl.runtime.roles import build_roles

    cfg = load_config(None, [*OPTIONS, "trainer.strategy=fsdp2", f"trainer.device={device}", f"model.dtype={dtype}"])
    dp = init_distributed(cfg.trainer)
    return dp, build_roles(cfg, cases.tiny_model().to(device), dp)[0]


def _named(module):
    return {n.removeprefix("policy."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def test_one_cpu_rank_equals_one_process():
    _, (plain, _, _) = cases.build(OPTIONS, sharded=False)
    want = plain.update(cases.make_batch("uneven"))
    dp, actor = _one_rank("cpu", "float32")
    try:
        assert dp.world_size == 1 and dp.sharded and dist.get_backend() == "gloo"
        got = actor.update(cases.make_batch("uneven"))
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-6)
        reference = dict(plain.model.named_parameters())
        weights = _named(actor.forward_module)
        for name, weight in weights.items():
            assert (weight - reference[name]).abs().max() <= 1e-6, name
        streamed = {name: tensor.clone() for name, tensor in full_tensors(actor.forward_module, 4096, "policy.")}
        assert streamed.keys() == weights.keys()
        assert all(torch.equal(streamed[name], weights[name]) for name in weights)
    finally:
        shutdown(dp)


@pytest.mark.gpu
def test_one_gpu_rank_bf16_compute_fp32_master():
    dp, actor = _one_rank("cuda", "bfloat16")
    try:
        before = _named(actor.forward_module)
        assert all(w.dtype == torch.float32 for w in before.values())  # the master shards
        metrics = actor.update(cases.make_batch("uneven"))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        after = _named(actor.forward_module)
        assert all(not torch.equal(before[k], after[k]) for k in before)
        moments = [s["exp_avg"] for s in actor.optimizer.state.values()]
        assert moments and all(m.to_local().device.type == "cpu" and m.to_local().is_pinned() for m in moments)
        for name, tensor in full_tensors(actor.forward_module, 1 << 20, "policy."):
            assert tensor.dtype == torch.bfloat16 and tensor.is_cuda
            assert torch.equal(tensor, after[name].to(torch.bfloat16)), name
    finally:
        shutdown(dp)
