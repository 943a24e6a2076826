"""The rollout engine in its own OS process (``runtime.rollout_process=true``): async steps run
with the bound kept and the probe passing, weights travel through shared memory, an error in
the child comes back with its traceback, and a dead child fails the run instead of hanging it."""
import json
import os
import signal
import time

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data.tasks import build_task
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.executors.process import ProcessRolloutBackend, RolloutProcessError
from asyncrl.runtime.pipeline import prepare_policy, run_training
from asyncrl.runtime.weight_sync import LogprobProbe, WeightSyncError
from asyncrl.types import SamplingParams
from tests.runtime.child_exit import assert_stopped_cleanly

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "trainer.eval_samples=0"]
ASYNC = ["runtime.mode=async", "runtime.max_staleness=1", "runtime.rollout_process=true",
         "algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


def length_reward(prompt, response, **fields):
    return float(len(response) % 2)


def policy(cfg):
    return prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)[:2]


@pytest.mark.parametrize("kv, device", [("keep", "cpu"), ("recompute", None)])
def test_async_run_with_rollout_in_a_process(cfg_of, tmp_path, kv, device):
    """``device``: an explicit ``runtime.rollout_device`` where the child generates (None: the
    trainer's device, the default)."""
    explicit = [f"runtime.rollout_device={device}"] if device else []
    summary = run_training(cfg_of(*ASYNC, "trainer.steps=5", f"runtime.partial_rollout_kv={kv}", *explicit))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 5 and len(rows) == 5
    assert all(r["async/staleness_violations"] == 0 for r in rows)
    # the child runs the pushed weights (the probe of push v is reported by push v + 1: deferred)
    assert "weight_sync/probe_gap" not in rows[0] and all(r["weight_sync/probe_gap"] < 1e-3 for r in rows[1:])
    assert max(r["async/staleness_max"] for r in rows) >= 1  # it ran ahead of the trainer


@pytest.fixture(scope="module")
def child(sft_cache, tmp_path_factory):
    """(model, tokenizer, backend): one rollout process shared by the tests that only call it
    (each spawn costs seconds). The probe test runs first: it leaves the child on perturbed
    weights, which the error test's checks do not depend on."""
    run = tmp_path_factory.mktemp("child")
    model, tok = policy(load_config("quickstart", FAST + [f"logging.run_dir={run}", f"sft.cache_dir={sft_cache}"]))
    backend = ProcessRolloutBackend(model, tok, "engine")
    yield model, tok, backend
    backend.close()


def test_the_probe_runs_in_the_child_and_catches_an_engine_on_other_weights(child):
    """The probe (engine sample + HF forward over the shared tensors) runs in the child. Shared
    tensors changed behind the engine's back (what a child that skipped the load looks like)
    make it fail with WeightSyncError in the trainer."""
    model, tok, backend = child
    probe = LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend.update_weights(model.named_parameters(), 1)
    assert backend.run_probe(probe, 1).gap < 1e-4
    with torch.no_grad():
        for t in backend.shared.values():
            t.add_(0.05 * torch.randn_like(t))  # the engine did not load these
    with pytest.raises(WeightSyncError, match="did not take"):
        backend.run_probe(probe, 1)


def test_an_error_in_the_child_comes_back_with_its_traceback(child):
    _, tok, backend = child
    ok = backend.generate([tok("1+2=")["input_ids"]], SamplingParams(n=2, max_tokens=3, seed=0, logprobs=True))
    assert len(ok[0].completions) == 2
    with pytest.raises(RolloutProcessError, match="(?s)Traceback.*IndexError"):
        backend.generate([[10 ** 6]], SamplingParams(max_tokens=2))  # token id outside the vocabulary


def test_the_child_owns_the_engine_and_reads_shared_weights(cfg_of):
    cfg = cfg_of(*ASYNC)
    model, tok = policy(cfg)
    ctrl = build_async_controller(cfg, model, tok, length_reward, build_task(cfg.task, cfg.seed).train_stream(0))
    backend = ctrl.backend
    try:
        assert isinstance(backend, ProcessRolloutBackend) and backend.pid != os.getpid()
        assert all(t.is_shared() for t in backend.shared.values())
        metrics = [ctrl.step(s) for s in (1, 2, 3)]
        metrics[-1].update(ctrl.weight_sync.wait())  # push 3 is acked and probed in the background
        assert backend.version == 3 and ctrl.staleness.version == 3 and all(m["weight_sync/probe_gap"] < 1e-3 for m in metrics[1:])
        trained = dict(model.named_parameters())
        assert all(torch.equal(t, trained[n].detach()) for n, t in backend.shared.items())  # the last push
    finally:
        ctrl.close()
    assert_stopped_cleanly(backend)


def test_a_dead_rollout_process_fails_the_run_past_max_restarts(cfg_of):
    cfg = cfg_of(*ASYNC, "runtime.max_restarts=0")
    model, tok = policy(cfg)
    ctrl = build_async_controller(cfg, model, tok, length_reward, build_task(cfg.task, cfg.seed).train_stream(0))
    try:
        ctrl.step(1)
        os.kill(ctrl.backend.pid, signal.SIGKILL)
        start = time.perf_counter()
        with pytest.raises(RolloutProcessError, match="died and runtime.max_restarts=0 restarts are used up"):
            for step in range(2, 10):  # the buffer may still hold a batch; the next push must fail
                ctrl.step(step)
        assert time.perf_counter() - start < 30
    finally:
        ctrl.close()


def test_a_rollout_process_killed_3_times_is_restarted_and_no_sample_is_lost(cfg_of, tmp_path, monkeypatch):
    """SIGKILL of the rollout process after steps 1, 2 and 3: each time a new one starts from
    the last pushed weights and the generate call in flight is re-sent, so every step still
    trains 4 groups x 4 samples and the staleness bound holds (bench/fault_injection.py:
    rollout-kills does the same at random steps of a longer run)."""
    import threading

    backends = []
    real_init = ProcessRolloutBackend.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        backends.append(self)
    monkeypatch.setattr(ProcessRolloutBackend, "__init__", remember)
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    killed = []

    def killer():
        while len(killed) < 3:
            rows = len(metrics_file.read_text().splitlines()) if metrics_file.is_file() else 0
            # a new row and a new process: the pid of a killed one stays until its restart,
            # and on a busy machine a row (from the buffer) can come first
            if rows > len(killed) and backends and backends[0].pid not in killed:
                killed.append(backends[0].pid)
                os.kill(backends[0].pid, signal.SIGKILL)
            time.sleep(0.02)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    summary = run_training(cfg_of(*ASYNC, "trainer.steps=5", "runtime.max_restarts=3"))
    thread.join(5)
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert summary["steps"] == 5 and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert len(set(killed)) == 3 and backends[0].restarts == 3 and rows[-1]["async/rollout_restarts"] == 3
    assert all(r["async/staleness_violations"] == 0 and r["batch/samples"] == 16 for r in rows)


def test_a_stopped_rollout_process_is_reported_not_waited_for_forever(cfg_of):
    """SIGSTOP: alive but silent. Past runtime.hang_timeout_s the step fails naming what hung."""
    from asyncrl.errors import HangError

    cfg = cfg_of(*ASYNC, "runtime.hang_timeout_s=3")
    model, tok = policy(cfg)
    ctrl = build_async_controller(cfg, model, tok, length_reward, build_task(cfg.task, cfg.seed).train_stream(0))
    pid = ctrl.backend.pid
    try:
        ctrl.step(1)
        os.kill(pid, signal.SIGSTOP)
        start = time.perf_counter()
        with pytest.raises(HangError, match="did not finish in 3 s"):
            for step in range(2, 10):
                ctrl.step(step)
        assert time.perf_counter() - start < 20
    finally:
        os.kill(pid, signal.SIGCONT)
        ctrl.close(abandon=True)


def test_rollout_device_needs_the_rollout_process(cfg_of):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="runtime.rollout_process=true"):
        build_async_controller(cfg_of(*ASYNC, "runtime.rollout_process=false", "runtime.rollout_device=cpu"),
                               None, None, length_reward, iter(()))


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["shared", "collective"])
def test_gpu_trainer_pushes_weights_to_the_rollout_process(cfg_of, tmp_path, transport):
    """The trainer on cuda:0; the child on the last GPU (cuda:1 on a two-GPU host). shared: the
    tensors stay on the trainer's GPU (CUDA IPC); collective: an NCCL broadcast into the child's
    copy. The probe passes after every push."""
    rollout_device = f"cuda:{torch.cuda.device_count() - 1}"
    summary = run_training(cfg_of(*ASYNC, "trainer.steps=4", "trainer.device=cuda",
                                  f"runtime.rollout_device={rollout_device}", "rollout.gpu_memory_utilization=0.3",
                                  f"runtime.weight_transport={transport}"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and all(r["async/staleness_violations"] == 0 for r in rows)
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in rows[1:])


def test_two_threads_joining_a_child_read_its_exit_code_once():
    """close() joins while the receiver thread joins on EOF: unguarded, one of two concurrent
    readers of a forkserver child's status reads EOF and multiprocessing records 255 (CPython
    gh-130895; 59 of 150 such trials here). ``_Child.join`` reads it under the child's lock."""
    import threading

    import torch.multiprocessing as mp

    from asyncrl.runtime.executors.process import _Child

    ctx = mp.get_context("forkserver")
    codes = []
    for _ in range(30):
        process = ctx.Process(target=time.sleep, args=(0.02,))
        process.start()
        conn, other = ctx.Pipe()
        child = _Child(process, conn, 0, "a test child", None)
        joins = [threading.Thread(target=child.join, args=(10.0,)) for _ in range(2)]
        for t in joins:
            t.start()
        for t in joins:
            t.join()
        codes.append(child.exitcode)
        conn.close(), other.close()
    assert codes == [0] * 30
