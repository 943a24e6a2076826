"""Bad launch input fails before any rank starts, with one line that names the cause and the key
to change: NCCL on a CPU-only machine, more ranks than GPUs, the single strategy on several ranks,
the async runtime with a sharded trainer."""
import pytest
import torch

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.distributed.group import check_local_ranks, comm_backend, rank_device, resolve_strategy
from asyncrl.distributed.launch import describe_failure
from asyncrl.runtime.validate import validate_config

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")


def test_strategy_auto_shards_only_several_ranks():
    assert resolve_strategy("auto", 1) == "single" and resolve_strategy("auto", 2) == "fsdp2"
    assert resolve_strategy("fsdp2", 1) == "fsdp2"
    with pytest.raises(ConfigError, match="trainer.strategy=single cannot run 4 ranks"):
        resolve_strategy("single", 4)


@no_cuda
def test_nccl_on_a_cpu_only_machine_is_named():
    with pytest.raises(ConfigError, match="trainer.dist_backend=nccl needs CUDA GPUs.*use trainer.dist_backend=gloo"):
        comm_backend("nccl", torch.device("cpu"))
    assert comm_backend("auto", torch.device("cpu")) == "gloo"


@no_cuda
def test_gpu_ranks_without_gpus_are_named():
    with pytest.raises(ConfigError, match="trainer.device=cuda but torch.cuda.is_available.. is False"):
        rank_device("cuda", 0)
    cfg = load_config(None, ["trainer.gpus=2", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match="trainer.device=cuda"):
        check_local_ranks(cfg.trainer, 2)


@no_cuda
def test_cli_refuses_before_launching(capsys):
    assert main(["train", "trainer.gpus=2", "trainer.device=cpu", "trainer.dist_backend=nccl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.dist_backend=nccl needs CUDA GPUs" in err


def test_async_with_a_sharded_trainer_is_refused():
    cfg = load_config(None, ["trainer.gpus=2", "runtime.mode=async", "algorithm.decoupled=true",
                             "algorithm.rollout_correction.level=token"])
    with pytest.raises(ConfigError, match="runs runtime.mode=sync"):
        validate_config(cfg)


def test_a_dead_rank_is_named_with_its_signal():
    line = describe_failure(1, -9, 4)
    assert line.startswith("rank 1 of 4 killed by SIGKILL; the other ranks were stopped")
    assert "exited with code 3" in describe_failure(0, 3, 2)


def test_full_offload_needs_the_sharded_trainer():
    cfg = load_config(None, ["actor.offload=full", "trainer.strategy=single"])
    with pytest.raises(ConfigError, match="actor.offload=full .* needs trainer.strategy=fsdp2"):
        validate_config(cfg)
