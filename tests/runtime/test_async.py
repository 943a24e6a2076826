"""The async runtime end to end on the tiny model: η = 0 equals sync, the bound holds in a run,
the probe catches a stale backend, a mid-generation update re-tags later tokens only,
stragglers never wedge a step, and configs without a correction are refused."""
import json
import threading
import time

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.rollout.hf import HFGenerateBackend
from asyncrl.runtime.async_controller import build_async_controller
from asyncrl.runtime.pipeline import prepare_policy, run_training
from asyncrl.runtime.sync_controller import build_sync_controller
from asyncrl.runtime.validate import validate_config
from asyncrl.runtime.weight_sync import (GenerationGate, LogprobProbe, WeightSync, WeightSyncError,
                                         clone_for_rollout)
from asyncrl.data.tasks import build_task

FAST = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=5", "sft.batch_size=16", "trainer.steps=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "task.num_eval=16", "logging.progress=false",
        "logging.tensorboard=false", "rollout.backend=hf",  # the engine has its own tests below
        "runtime.rollout_process=false"]  # the thread path; test_process_executor.py has the process one
DECOUPLED = ["algorithm.decoupled=true", "algorithm.rollout_correction.level=token"]


def length_reward(prompt, response, **fields):
    """A reward with variance inside groups, so every step moves the weights."""
    return float(len(response) % 2)


def stream(cfg):
    return build_task(cfg.task, cfg.seed).train_stream(cfg.seed)


def run_controller(controller, steps):
    try:
        return [controller.step(s) for s in range(1, steps + 1)]
    finally:
        getattr(controller, "close", lambda: None)()


@pytest.fixture()
def one_thread():
    """The rollout process computes with one thread (process.py); the trainer here too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("process", [False, True])  # the rollout backend in a thread / its own process
def test_async_eta_zero_reproduces_sync(cfg_of, process, one_thread):
    """η = 0 runs the sync controller's steps exactly: every metric and weight is bit-equal.

    Tolerance 0, derived rather than guessed: both runs do the same float32 operations in the
    same order once the two things that changed the rounding are the same on both sides. (1) The
    kernel: CPU linear layers take another code path for weights without grad, so the sync
    backend generates with a no-grad copy (clone_for_rollout) as the async one does. (2) The
    reduction split: the rollout process computes with one thread, so the trainer does too.
    With either left different, the sampled tokens' log-probs differed by ~2e-7 (a few fp32 ulps
    of the logits), which the decoupled-PPO weights carried into the update, and Adam, whose
    step ignores the gradient's scale, turned into weight differences of ~1e-6 after 3 steps at
    lr 1e-2 — the 1.14e-6 vs atol 1e-6 failure seen on some machines."""
    cfg_sync = cfg_of("actor.lr=1e-2")
    cfg_async = cfg_of("actor.lr=1e-2", "runtime.mode=async", "runtime.max_staleness=0",
                       f"runtime.rollout_process={str(process).lower()}")
    results = []
    for cfg in (cfg_sync, cfg_async):
        torch.manual_seed(cfg.seed)
        model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
        if cfg.runtime.mode == "sync":
            backend = HFGenerateBackend(clone_for_rollout(model), tok)  # synced after every update
            ctrl = build_sync_controller(cfg, model, backend, tok, length_reward, stream(cfg))
        else:
            ctrl = build_async_controller(cfg, model, tok, length_reward, stream(cfg))
        metrics = run_controller(ctrl, 3)
        results.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (m_sync, w_sync), (m_async, w_async) = results
    for a, b in zip(m_sync, m_async):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response/length_mean",
                    "rollout/logprob_gap", "rollout_correction/is_weight_mean"):
            assert a[key] == b[key], key
        assert b["async/staleness_max"] == 0
    assert any(a["actor/grad_norm"] > 0 for a in m_sync)  # the weights did move
    assert all(torch.equal(x, y) for x, y in zip(w_sync, w_async))


@pytest.mark.parametrize("backend", ["hf", "engine"])  # engine: weights pushed in flight (partial rollout)
def test_async_run_keeps_the_bound_and_reports_it(cfg_of, tmp_path, backend):
    summary = run_training(cfg_of("runtime.mode=async", "runtime.max_staleness=2", "trainer.steps=6",
                                  f"rollout.backend={backend}", *DECOUPLED))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and len(rows) == 6
    assert all(r["async/staleness_violations"] == 0 and r["async/staleness_max"] <= 2 for r in rows)
    for key in ("async/staleness_mean", "async/version_lag", "async/overlap", "time/wait_rollout",
                "time/wait_trainer", "time/weight_sync", "rollout_correction/is_weight_mean"):
        assert all(key in r for r in rows), key
    # hf: probed in the push (gated); engine: the probe overlaps the rollout and is checked before the
    # next update, so step k reports push k-1's probe (and the run's end checks the last one)
    probed = rows if backend == "hf" else rows[1:]
    assert all(r["weight_sync/probe_gap"] < 1e-3 for r in probed) and len(probed) >= 5
    assert max(r["async/staleness_max"] for r in rows) >= 1  # it did run ahead of the trainer


class StaleBackend(HFGenerateBackend):
    """Takes the version but never loads the weights: the failure the probe exists for."""

    def update_weights(self, named_tensors, version):
        self.version = version


def test_probe_catches_a_backend_that_ignores_the_weights(cfg_of):
    cfg = cfg_of()
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    probe = lambda: LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4)
    good = WeightSync(HFGenerateBackend(clone_for_rollout(model), tok), GenerationGate(), probe(), inflight=False)
    stale = WeightSync(StaleBackend(clone_for_rollout(model), tok), GenerationGate(), probe(), inflight=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert good.push(model, 1)["weight_sync/probe_gap"] < 1e-4
    with pytest.raises(WeightSyncError, match="did not take"):
        stale.push(model, 1)


class SnapshotBackend(HFGenerateBackend):
    """In flight, probing itself against a snapshot of the pushed weights (as the rollout
    process does); with ``stale`` it keeps generating with its first weights."""

    inflight_weight_update = True

    def __init__(self, model, tok, stale: bool):
        super().__init__(clone_for_rollout(model), tok)
        self.snapshot, self.stale = clone_for_rollout(model), stale

    def update_weights(self, named_tensors, version):
        named_tensors = list(named_tensors)
        HFGenerateBackend.update_weights(self, [] if self.stale else named_tensors, version)
        dict_ = dict(self.snapshot.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                dict_[name].copy_(tensor)

    def start_update(self, named_tensors, version):
        self.update_weights(named_tensors, version)
        return lambda: self.version

    def run_probe(self, probe, version):
        return probe.check(self, self.snapshot, version)


@pytest.mark.parametrize("stale", [False, True])
def test_deferred_probe_checks_every_sync_one_push_late(cfg_of, stale):
    cfg = cfg_of()
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    loaded = []
    sync = WeightSync(SnapshotBackend(model, tok, stale), GenerationGate(),
                      LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4), inflight=True,
                      on_loaded=loaded.append)
    assert sync.deferred
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    first = sync.push(model, 1)  # the probe of version 1 runs in the background: no probe metrics yet
    assert "weight_sync/probe_gap" not in first
    assert first["weight_sync/bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    if stale:
        with pytest.raises(WeightSyncError, match="did not take"):
            sync.push(model, 2)
        return
    assert sync.push(model, 2)["weight_sync/probe_gap"] < 1e-4  # version 1's result
    sync.close()  # version 2's probe, checked at the end
    assert loaded == [1, 2]  # the admission version rose after each load


def test_engine_weight_update_mid_generation_retags_later_tokens(cfg_of):
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.types import SamplingParams

    cfg = cfg_of()
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    backend = EngineBackend(model, tok, device="cpu", dtype=torch.float32, block_size=4)
    sync = WeightSync(backend, GenerationGate(), LogprobProbe(tok("1+2=")["input_ids"], 1.0, 1e-3), inflight=True)
    out = {}
    prompt = tok("12+34=")["input_ids"]
    worker = threading.Thread(target=lambda: out.setdefault("o", backend.generate(
        [prompt], SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1, ignore_eos=True))))
    worker.start()
    while backend.llm.num_steps < 5:
        time.sleep(0.0005)
    backend.llm.pause()  # hold the generation mid-way (on a fast machine it would otherwise finish first)
    assert backend.llm.num_steps < 40
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # in flight: the generate call is still running; the push's probe generates too, so resume
    # the engine once the new weights are in (not before: the rest must run on version 1)
    pusher = threading.Thread(target=lambda: out.setdefault("metrics", sync.push(model, 1)))
    pusher.start()
    deadline = time.monotonic() + 60
    while backend.version != 1 and time.monotonic() < deadline:
        time.sleep(0.0005)
    backend.llm.resume()
    pusher.join(60)
    worker.join(60)
    metrics = out["metrics"]
    assert metrics["weight_sync/probe_gap"] < 1e-3
    for c in out["o"][0].completions:
        v = c.versions
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v)  # earlier tokens keep 0, later ones get 1


def slow_reward(prompt, response, **fields):
    """One prompt in ten hangs for 3 s (a stuck verifier)."""
    if sum(map(ord, prompt)) % 10 == 0:
        time.sleep(3.0)
    return float(len(response) % 2)


@pytest.mark.parametrize("policy", ["drop", "partial"])
def test_a_slow_group_never_wedges_a_step(cfg_of, policy):
    cfg = cfg_of("runtime.mode=async", "runtime.max_staleness=1", "runtime.group_timeout_s=0.5",
                 f"runtime.straggler_policy={policy}", "runtime.reward_workers=8", *DECOUPLED)
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    ctrl = build_async_controller(cfg, model, tok, slow_reward, stream(cfg))
    start = time.perf_counter()
    metrics = run_controller(ctrl, 4)
    assert time.perf_counter() - start < 2.5 * 4  # a hung group costs at most its budget, not 3 s each
    assert metrics[-1]["async/groups_timed_out"] >= 1
    assert all(m["async/staleness_violations"] == 0 for m in metrics)


@pytest.mark.parametrize("extra, needle", [
    (["runtime.mode=async", "algorithm.decoupled=false", "algorithm.rollout_correction.level=none"],
     "algorithm.decoupled=true"),
    (["runtime.mode=async", "runtime.sync_every=3", *DECOUPLED], "deadlock"),
    (["runtime.executor=ray"], "runtime.mode=async"),
])
def test_async_configs_without_what_they_need_are_refused(cfg_of, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_config(cfg_of(*extra))
    validate_config(cfg_of("runtime.mode=async", "runtime.max_staleness=0"))  # on-policy needs no correction


@pytest.mark.parametrize("policy, kept", [("partial", [0, 2]), ("drop", None)])
def test_expired_group_is_settled_once_by_the_policy(policy, kept):
    from asyncrl.runtime.buffer import RolloutBuffer
    from asyncrl.runtime.executors.rollout_loop import InFlight, PendingGroup
    from asyncrl.runtime.staleness import StalenessManager
    from asyncrl.types import Completion, Example, RequestOutput

    manager, buffer = StalenessManager(1, 0, 4), RolloutBuffer(1)
    inflight = InFlight(manager, buffer, policy)
    gid = manager.admit(1)[0]
    comps = [Completion([i], str(i), [0.0], "stop", [0]) for i in range(4)]
    inflight.add(PendingGroup(gid, Example("p", "a"), 0, deadline=1.0, output=RequestOutput([1], None, comps)))
    inflight.record_score(gid, 0, 1.0, 1.0)
    inflight.record_score(gid, 2, 0.0, 0.0)
    inflight.expire(now=2.0)               # completions 1 and 3 never scored in time
    inflight.record_score(gid, 1, 1.0, 1.0)  # a late score is ignored
    assert manager.running == 0 and inflight.timed_out == 1
    if kept is None:
        assert manager.released == 1 and len(buffer) == 0
    else:
        (g,) = buffer.take(1)
        assert [c.token_ids[0] for c in g.output.completions] == kept and g.scores == [1.0, 0.0]
        assert manager.accepted == 1 and inflight.partial == 1


def test_the_quickstart_recipe_runs_async_as_shipped():
    """`asyncrl train runtime.mode=async` needs no other override: the recipe's decoupled PPO is
    the correction, and in sync mode it costs no π_prox forward (one optimizer step per batch)."""
    from asyncrl.training.actor import needs_recomputed_old_logprobs

    cfg = load_config("quickstart", ["runtime.mode=async"])
    validate_config(cfg)
    assert cfg.algorithm.decoupled and cfg.algorithm.rollout_correction.enabled and cfg.runtime.max_staleness >= 1
    assert not needs_recomputed_old_logprobs(cfg.actor, cfg.algorithm)


def test_async_evaluation_sees_the_trained_weights(cfg_of, monkeypatch):
    """The held-out eval backend is not the async rollout backend: at every evaluation (before,
    during, after RL) it must run the trainer's current weights, not the warm start."""
    import asyncrl.runtime.pipeline as pipeline

    seen, gaps = {}, []
    real_prepare, real_accuracy = pipeline.prepare_policy, pipeline.heldout_accuracy

    def prepare(*args, **kwargs):
        seen["model"], tok, info = real_prepare(*args, **kwargs)
        seen["tok"] = tok
        return seen["model"], tok, info

    def accuracy(backend, *args, **kwargs):
        probe = seen.setdefault("probe", LogprobProbe(seen["tok"]("12+34=")["input_ids"], 1.0, tolerance=1e-3))
        result = probe.check(backend, seen["model"], backend.version)  # raises if the backend is stale
        gaps.append(result.gap)
        seen.setdefault("deltas", []).append(result.delta)
        return real_accuracy(backend, *args, **kwargs)

    monkeypatch.setattr(pipeline, "prepare_policy", prepare)
    monkeypatch.setattr(pipeline, "heldout_accuracy", accuracy)
    # the entropy bonus moves the weights every step even when every reward is 0
    # eval_every=3 of 4 steps: the final eval runs on its own (at a multiple of eval_every it reuses
    # that step's eval of the same weights)
    run_training(cfg_of("runtime.mode=async", "rollout.backend=engine", "actor.lr=1e-2", "trainer.eval_every=3",
                        "trainer.eval_samples=0", "algorithm.entropy_coeff=0.5", *DECOUPLED))
    assert len(gaps) == 3 and max(gaps) < 1e-3  # before, step 3, after (step 4)
    assert min(seen["deltas"][1:3]) > 1e-2  # the weights moved between evaluations


class InflightBackend(HFGenerateBackend):
    """An HF clone as the engine's path sees it: loads in flight, generate callable from two threads."""

    inflight_weight_update = True
    concurrent_generate = True


class StaleInflightBackend(InflightBackend):
    """The same, but it never loads the weights."""

    def update_weights(self, named_tensors, version):
        self.version = version


@pytest.mark.parametrize("stale", [False, True])
def test_overlapped_probe_checks_the_push_before_the_next_update(cfg_of, stale):
    """The engine's path: the push loads and returns; the probe's generate runs in the background
    and ``finish_probe`` compares it with the trainer (still on the pushed weights). A backend that
    ignored the weights fails there; a second push without it is refused (the weights moved)."""
    cfg = cfg_of()
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    backend = (StaleInflightBackend if stale else InflightBackend)(clone_for_rollout(model), tok)
    loaded = []
    sync = WeightSync(backend, GenerationGate(), LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4),
                      inflight=True, on_loaded=loaded.append, overlap_probe=True)
    assert sync.overlapped and not sync.deferred
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pushed = sync.push(model, 1)
    assert "weight_sync/probe_gap" not in pushed
    with pytest.raises(RuntimeError, match="finish_probe"):
        sync.push(model, 2)
    if stale:
        with pytest.raises(WeightSyncError, match="did not take"):
            sync.finish_probe(model)
        return
    assert sync.finish_probe(model)["weight_sync/probe_gap"] < 1e-4 and sync.finish_probe(model) == {}
    assert loaded == [1]  # admission rose once the backend's probe tokens were out
    sync.close(model=model)


@pytest.mark.parametrize("overlap", [True, False])
def test_probe_every_n_probes_the_first_push_and_every_nth(cfg_of, overlap):
    """``runtime.probe_every=2``: pushes 1 and 3 are probed, push 2 loads only (admitted at once);
    a stale backend is still caught, at the next probed push."""
    cfg = cfg_of()
    model, tok, _ = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)
    backend = StaleInflightBackend(clone_for_rollout(model), tok)
    loaded = []
    sync = WeightSync(backend, GenerationGate(), LogprobProbe(tok("12+34=")["input_ids"], 1.0, tolerance=1e-4),
                      inflight=True, on_loaded=loaded.append, overlap_probe=overlap, probe_every=2)
    probed = []
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        try:
            metrics = sync.push(model, version)
            if overlap:
                metrics.update(sync.finish_probe(model))
        except WeightSyncError:
            probed.append((version, "caught"))
            continue
        probed.append((version, metrics["weight_sync/probed"], "weight_sync/probe_gap" in metrics))
    assert probed == [(1, "caught"), (2, 0.0, False), (3, "caught")]
    assert 2 in loaded
