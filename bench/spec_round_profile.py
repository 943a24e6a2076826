"""Where a speculative round's time goes: per phase host ms vs device ms, and runtime calls per round.

``profile_rounds(llm, prompts, params, rounds)`` (used by ``spec_eagle.py --profile-rounds N``) runs
two generations of an engine with speculation on, after the timed ones (warm):

1. phases: ``schedule`` (``Scheduler.schedule_verify``), ``propose`` (drafting), ``verify`` (the target pass + the verifier, ``VerifyStep.run``),
   ``verified`` (the proposer keeps features) and ``postprocess`` (``Scheduler.postprocess_verify``),
   each isolated by a device sync before and after, over the first ``rounds`` rounds after a
   sequence's first (eager) one: ``host_ms`` = until the call returns on the host (verify reads
   its result back, so it includes waiting for its kernels: ``readback_wait_ms``, the time inside
   ``Tensor.cpu``; ``host_work_ms`` = host_ms - that), ``device_ms`` = CUDA events around
   the phase (the device's span from its first to its last kernel: with a slow host it is the
   host's launch time, not the kernels'), ``wall_ms`` = both. Without the syncs the phases
   overlap a little; the timed run's ms per step is the real total (minus ``sum_wall_ms``: the
   engine loop's own host time per round).
2. ``torch.profiler`` over a whole generation: per round, the device's busy time (sum of its
   kernels) and the CUDA runtime calls (kernel launches, graph launches, copies, syncs) -- a host
   that launches 100 kernels per round spends ~0.5 ms doing it.

On CPU only the host times (and aten op counts) mean anything.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

RUNTIME_CALLS = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaDeviceSynchronize", "cuLaunchKernel", "cudaLaunchKernelExC")


def _phase_wrappers(llm, record: dict, state: dict):
    """(object, attribute, wrapper) per phase: the wrapper times the call when ``state['on']``."""
    spec, cuda = llm.spec, llm.runner.is_cuda

    def wrap(name, fn):
        def timed_call(*a, **kw):
            if not state["on"]:
                return fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            waited = [0.0]
            cpu = torch.Tensor.cpu

            def timed_cpu(t, *ca, **ckw):  # a read-back inside the phase: the host waits for the device
                w0 = time.perf_counter()
                r = cpu(t, *ca, **ckw)
                waited[0] += time.perf_counter() - w0
                return r

            torch.Tensor.cpu = timed_cpu
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
            finally:
                torch.Tensor.cpu = cpu
            t1 = time.perf_counter()
            dev = None
            if cuda:
                e1.record()
                torch.cuda.synchronize()
                dev = e0.elapsed_time(e1)
            record[name].append((1e3 * (t1 - t0), dev, 1e3 * (time.perf_counter() - t0), 1e3 * waited[0]))
            return out
        return timed_call

    targets = [("schedule", llm.scheduler, "schedule_verify"), ("propose", spec.proposer, "propose"), ("verify", spec.verify_step, "run"),
               ("verified", spec.proposer, "verified"), ("postprocess", llm.scheduler, "postprocess_verify")]
    return [(obj, attr, wrap(name, getattr(obj, attr))) for name, obj, attr in targets]


def _phase_times(llm, prompts, params, rounds: int) -> dict:
    record, state = defaultdict(list), {"on": False, "round": 0}
    wrappers = _phase_wrappers(llm, record, state)
    step = llm.spec.step

    def counted_step(scheduler, version):  # record rounds 2..rounds+1 (round 1 of a sequence is eager)
        state["round"] += 1
        state["on"] = 2 <= state["round"] <= rounds + 1
        return step(scheduler, version)

    for obj, attr, w in wrappers:
        setattr(obj, attr, w)
    llm.spec.step = counted_step
    try:
        llm.generate(prompts, params)
    finally:
        for obj, attr, _ in wrappers:
            delattr(obj, attr)  # the instance attribute hid the class's method
        del llm.spec.step
    out = {}
    for name, rows in record.items():
        n = len(rows)
        host, wall = sum(r[0] for r in rows) / n, sum(r[2] for r in rows) / n
        dev = sum(r[1] for r in rows) / n if rows[0][1] is not None else None
        wait = sum(r[3] for r in rows) / n
        out[name] = dict(host_ms=round(host, 3), device_ms=None if dev is None else round(dev, 3),
                         wall_ms=round(wall, 3), readback_wait_ms=round(wait, 3), host_work_ms=round(host - wait, 3))
    out["rounds"] = len(record.get("propose", []))
    out["sum_wall_ms"] = round(sum(v["wall_ms"] for k, v in out.items() if isinstance(v, dict)), 3)
    return out


def _runtime_counts(llm, prompts, params) -> dict:
    """Per speculative round over one whole generation: device busy ms and CUDA runtime calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.runner.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    s0 = llm.metrics["spec_steps"]
    with profile(activities=acts) as prof:
        llm.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
    rounds = max(llm.metrics["spec_steps"] - s0, 1)
    events = prof.key_averages()
    out = dict(rounds=rounds)
    if cuda:
        busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        out["device_busy_ms_per_round"] = round(busy / 1e3 / rounds, 3)
        for e in events:
            if e.key in RUNTIME_CALLS:
                out[f"{e.key}_per_round"] = round(e.count / rounds, 1)
    else:
        out["aten_ops_per_round"] = round(sum(e.count for e in events if e.key.startswith("aten::")) / rounds, 1)
    return out


def profile_rounds(llm, prompts, params, rounds: int) -> dict:
    """``{"phases": ..., "profiler": ...}`` for ``rounds`` rounds of ``llm`` (speculation on)."""
    if llm.spec is None:
        raise ValueError("profile_rounds: the engine has no speculative_config")
    out = dict(phases=_phase_times(llm, prompts, params, rounds), profiler=_runtime_counts(llm, prompts, params))
    # how the engine's verify passes ran so far (graph_tail: sampler + verifier inside the bucket's graph)
    out["verify_paths"] = dict(getattr(llm.spec.verify_step, "rounds", {}))
    return out
