"""Starting a rollout fleet: what is wrong is said before anything starts (a TP size that does
not split the model, more replicas x TP than GPUs, a fleet in sync mode), and a replica that
never becomes ready is named, with its log, within the timeout."""
import multiprocessing
import re
import time

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl import cli
from asyncrl.config import ConfigError, load_config
from asyncrl.engine.parallel import TensorParallelError
from asyncrl.runtime.executors.process import RolloutProcessError
from asyncrl.runtime.executors.replicas import FleetConfigError, fleet_devices, start_fleet
from asyncrl.runtime.validate import validate_config

ASYNC = ["runtime.mode=async", "algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


class HangOnLoad:
    """Unpickling it never returns: a replica stuck while starting (an import, a lock, a driver)."""

    def __reduce__(self):
        return time.sleep, (3600,)


def tiny_policy():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=4, intermediate_size=32))


def test_replicas_are_placed_tp_gpus_apart():
    assert fleet_devices("cuda:1", 2, 2, visible=8) == ["cuda:1", "cuda:3"]
    assert fleet_devices("cpu", 3, 2) == ["cpu"] * 3
    with pytest.raises(FleetConfigError, match=re.escape("rollout.engines=2 x rollout.tensor_parallel_size=4 needs "
                                                         "8 GPU(s) (cuda:1..cuda:8), but 4 are visible")):
        fleet_devices("cuda:1", 2, 4, visible=4)


def test_more_replicas_times_tp_than_gpus_fails_before_any_model_loads(capsys):
    args = ["train", "quickstart", *ASYNC, "rollout.engines=2", "rollout.tensor_parallel_size=4",
            "runtime.rollout_device=cuda:1", "sft.cache_dir=/nonexistent/never/written"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error: .*needs 8 GPU\(s\) \(cuda:1\.\.cuda:8\), but \d+ are visible", err)


def test_a_fleet_needs_async_mode():
    with pytest.raises(ConfigError, match="rollout.engines=2 x rollout.tensor_parallel_size=1 runs engine replicas "
                                          "beside the trainer: set runtime.mode=async"):
        validate_config(load_config("quickstart", ["rollout.engines=2"]))


def test_a_tp_size_that_does_not_split_the_model_is_refused_before_spawning(tmp_path):
    with pytest.raises(TensorParallelError, match="valid sizes: 1, 2, 4$"):
        start_fleet(tiny_policy(), None, "engine", engines=2, tensor_parallel_size=3, rollout_device="cpu",
                    log_dir=tmp_path)
    assert multiprocessing.active_children() == []


def test_a_replica_that_never_becomes_ready_is_named_with_its_log(tmp_path):
    started = time.monotonic()
    with pytest.raises(RolloutProcessError, match=r"rollout replica 0 \(pid \d+\) did not become ready within 3s; "
                                                  r"its log: .*replica0\.log$"):
        start_fleet(tiny_policy(), HangOnLoad(), "engine", engines=1, tensor_parallel_size=1, rollout_device="cpu",
                    log_dir=tmp_path, start_timeout_s=3)
    assert time.monotonic() - started < 30 and (tmp_path / "replica0.log").exists()
    assert multiprocessing.active_children() == []  # the stuck replica was killed


@pytest.mark.parametrize("overrides, message", [
    (["workflow.fn=calculator"], "a rollout fleet .* does not serve workflows yet: set both to 1"),
    (["rollout.backend=openai", "rollout.openai.base_url=http://127.0.0.1:1"],
     "rollout.engines and rollout.tensor_parallel_size belong to that server"),
])
def test_a_fleet_with_a_workflow_or_a_server_backend_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config("quickstart", [*ASYNC, "rollout.engines=2", *overrides]))


def test_merged_lora_serving_on_a_fleet_is_refused_not_ignored():
    """The replicas are built without the LoRA options: merged serving would silently be unmerged."""
    lora = ["actor.lora.rank=4", "actor.lora.merged_rollout=true"]
    with pytest.raises(ConfigError, match="actor.lora.merged_rollout=true with a rollout fleet"):
        validate_config(load_config("quickstart", [*ASYNC, "rollout.engines=2", *lora]))
    validate_config(load_config("quickstart", [*ASYNC, "rollout.engines=2", "actor.lora.rank=4"]))


def test_speculative_decoding_with_tp_above_one_is_refused():
    with pytest.raises(ConfigError, match="speculative decoding runs at tensor_parallel_size=1 only"):
        validate_config(load_config("quickstart", [*ASYNC, "rollout.tensor_parallel_size=2",
                                                   "rollout.speculative.method=ngram"]))
    validate_config(load_config("quickstart", [*ASYNC, "rollout.engines=2", "rollout.speculative.method=ngram"]))
