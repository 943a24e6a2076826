"""Where a rollout's decode steps leave the GPU idle: a device timeline of windows of steps.

Runs one of ``asyncrl bench rollout``'s workloads (a: 256 x 256+256; c: nano-vllm's 256
random-length requests) step by step through ``LLM.step`` and, in windows of ``--window``
steps, records the GPU's kernels and copies with torch.profiler (CUDA activity only, so the
host side is not slowed by op recording). Per window: the host's wall time per step, the
GPU's busy time per step (the union of its kernel/copy intervals), the idle time between
them, and the largest idle gaps by the pair of kernels around them, each split into the time the
device waited for the host (the call that issued the next op started after the device went idle)
and the device's own latency, from the window's second step on (its first step refills the
pipeline after the window's synchronize). Wall minus busy is what overlapping the host with the
device has not hidden yet; busy is what faster kernels can win. ``--keep-traces DIR`` keeps each
window's chrome trace. Each window also lists its kernels by total device time (``kernels``): with
``--windows 0`` and a window as long as the prefill steps, where a run's prefill goes.

    python bench/decode_timeline.py --workload a --json bench/results/decode_timeline_a.json
    python bench/decode_timeline.py --workload c --windows 100,400,700,900
    python bench/decode_timeline.py --workload c --warmup --windows 0 --window 10   # (c)'s 9 prefill steps

It also prints the step mix of the whole run (``StepMix``): host wall time and tokens by prefill and by
decode batch size, over the steps outside the profiled windows.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import build_random_hf, provenance, workload_a, workload_c, write_json  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        return json.load(f)["traceEvents"]


def device_intervals(events: list[dict]) -> list[tuple[float, float, str, int]]:
    """(start us, end us, name, correlation id) of every GPU kernel / copy / memset in a chrome trace, by
    start. A kernel of a CUDA graph carries its ``cudaGraphLaunch``'s correlation id."""
    out = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("correlation", -1))
           for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    return sorted(out)


def host_issue_times(events: list[dict]) -> dict[int, float]:
    """Correlation id -> start (us, the trace's clock) of the CUDA runtime / driver call that issued it."""
    return {e["args"]["correlation"]: e["ts"] for e in events
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def busy_and_gaps(intervals: list[tuple], min_gap_us: float = 2.0):
    """Union busy time (us) over the intervals, total span, and the idle gaps >= ``min_gap_us``
    as (gap us, name before, name after, idle-from us, correlation id after)."""
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = intervals[0][:3]
    for start, end, name, corr in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= min_gap_us:
                gaps.append((start - cur_end, cur_name, name, cur_end, corr))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return busy, intervals[-1][1] - intervals[0][0], gaps


def short(name: str) -> str:
    return name.split("(")[0].replace("void ", "")[:48]


def kernel_totals(intervals: list[tuple], steps: int, top: int) -> list[dict]:
    """The ``top`` kernels / copies by total device time: name (``short``), calls, ms per step, share of the total."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name, _ in intervals:
        by_name[short(name)][0] += 1
        by_name[short(name)][1] += end - start
    total = sum(t for _, t in by_name.values()) or 1.0
    return [dict(name=n, calls=c, ms_per_step=round(t / 1e3 / steps, 4), share=round(t / total, 3))
            for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]


def summarize(trace_path: str, steps: int, wall_s: float, batch_sizes: list[int], top: int) -> dict:
    """Per step: wall, GPU busy / span / idle, and the largest gaps (>= 2 us) by (op before, op after) from the
    window's second step on (``steady_*``: per step after the first). A gap is ``host_late`` where the call that
    issued the op after it started after the device went idle (the device waited for the host), else the
    device's own latency between queued work."""
    events = load_events(trace_path)
    intervals = device_intervals(events)
    busy, span, gaps = busy_and_gaps(intervals)
    issued = host_issue_times(events)
    by_pair = collections.defaultdict(lambda: [0, 0.0, 0.0])
    late_total = 0.0
    # the window opens on a synchronized device: its first step's inputs reach an idle GPU whatever the
    # steady state (the host fills the pipeline again). Gaps are counted from the second step's input copy
    copies = [start for start, _, name, _ in intervals if name.startswith("Memcpy HtoD")]
    steady_from = copies[1] if len(copies) > 1 else float("inf")
    gaps = [g for g in gaps if g[3] >= steady_from]
    steps_counted = max(steps - 1, 1)
    for gap, before, after, idle_from, corr in gaps:
        entry = by_pair[(short(before), short(after))]
        late = corr in issued and issued[corr] >= idle_from
        entry[0] += 1
        entry[1] += gap
        entry[2] += gap if late else 0.0
        late_total += gap if late else 0.0
    worst = sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:top]
    per_step = lambda us: round(us / 1e3 / steps, 4)  # noqa: E731
    per_steady_step = lambda us: round(us / 1e3 / steps_counted, 4)  # noqa: E731
    return dict(steps=steps, mean_batch=round(sum(batch_sizes) / max(len(batch_sizes), 1), 1),
                wall_ms_per_step=round(wall_s * 1e3 / steps, 3), gpu_busy_ms_per_step=per_step(busy),
                gpu_span_ms_per_step=per_step(span), idle_ms_per_step=per_step(span - busy),
                steady_gap_ms_per_step=per_steady_step(sum(g[0] for g in gaps)),
                steady_host_late_ms_per_step=per_steady_step(late_total), runtime_calls_seen=len(issued),
                kernels=kernel_totals(intervals, steps, 2 * top),
                gaps=[dict(before=b, after=a, count=c, ms_per_step=per_steady_step(t),
                           host_late_ms_per_step=per_steady_step(h)) for (b, a), (c, t, h) in worst])


DECODE_BUCKETS = (32, 64, 128, 256)


def step_kind(batch) -> str:
    """``prefill``, or ``decode <=N``: the smallest of ``DECODE_BUCKETS`` that holds the decode's rows."""
    if batch.is_prefill:
        return "prefill"
    rows = len(batch.seqs)
    return next((f"decode <={b}" for b in DECODE_BUCKETS if rows <= b), f"decode >{DECODE_BUCKETS[-1]}")


class StepMix:
    """Host wall time of every engine step by the kind of batch it launched (``step_kind``), with the tokens
    those batches computed: where a whole run's time goes (prefill vs decode by batch size). Under async
    scheduling a step's wall is mostly the wait on the previous batch, so a kind's time is off by about one step
    at each change of kind: fine over hundreds of steps."""

    def __init__(self):
        self.kinds: dict[str, dict] = collections.defaultdict(lambda: dict(steps=0, seconds=0.0, tokens=0))
        self.last: str | None = None

    def launched(self, batch) -> None:
        self.last = step_kind(batch)
        self.kinds[self.last]["tokens"] += sum(s.num_scheduled_tokens for s in batch.seqs)

    def stepped(self, seconds: float) -> None:
        if self.last is not None:
            self.kinds[self.last]["steps"] += 1
            self.kinds[self.last]["seconds"] += seconds

    def summary(self) -> dict:
        total = sum(k["seconds"] for k in self.kinds.values()) or 1.0
        return {name: dict(steps=k["steps"], tokens=k["tokens"], seconds=round(k["seconds"], 3),
                           share=round(k["seconds"] / total, 3)) for name, k in sorted(self.kinds.items())}


def run(args) -> dict:
    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", 4096)
    llm = LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=512, max_num_batched_tokens=16384,
              max_model_len=4096, gpu_memory_utilization=0.6, kv_cache_dtype=args.kv_cache_dtype)
    llm.generate([[1] * 16] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    vocab = hf.config.vocab_size
    if args.workload == "a":
        prompts, one = workload_a(vocab)
        params = [one] * len(prompts)
    else:
        prompts, params = workload_c(vocab)
    if args.warmup:
        llm.generate(prompts, params)
        llm.block_manager.set_namespace(llm.block_manager.namespace)  # no prefix-cache hits in the timed run
    starts = sorted(int(s) for s in args.windows.split(","))
    sizes: list[int] = []
    launch_s: list[float] = []
    launch = llm.runner.launch
    mix = StepMix()

    def counting_launch(batch):
        sizes.append(0 if batch.is_prefill else len(batch.seqs))
        mix.launched(batch)
        t = time.perf_counter()
        handle = launch(batch)
        launch_s.append(time.perf_counter() - t)
        return handle

    llm.runner.launch = counting_launch
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    windows, step, t_all = [], 0, time.perf_counter()
    tmp = args.keep_traces or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    while llm.has_unfinished():
        if starts and step == starts[0]:
            starts.pop(0)
            torch.cuda.synchronize()
            first = len(sizes)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:  # + runtime calls
                t0 = time.perf_counter()
                n = 0
                while n < args.window and llm.has_unfinished():
                    llm.step()
                    n += 1
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            path = os.path.join(tmp, f"w{step}.json")
            prof.export_chrome_trace(path)
            window = summarize(path, n, wall, [s for s in sizes[first:] if s], args.top)
            window["first_step"] = step
            window["prefill_steps"] = sum(1 for s in sizes[first:] if s == 0)
            window["host_launch_ms_per_step"] = round(sum(launch_s[first:]) * 1e3 / max(n, 1), 3)
            print(json.dumps(window), flush=True)
            windows.append(window)
            step += n
            continue
        t = time.perf_counter()
        llm.step()
        mix.stepped(time.perf_counter() - t)
        step += 1
    total = time.perf_counter() - t_all
    print("step mix (unprofiled steps):", json.dumps(mix.summary()), flush=True)
    return dict(workload=args.workload, kv_cache_dtype=args.kv_cache_dtype, steps=step,
                seconds_with_profiled_windows=round(total, 3), windows=windows, step_mix=mix.summary())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="a", choices=("a", "c"))
    ap.add_argument("--windows", default="40,150,240", help="first engine step of each profiled window")
    ap.add_argument("--window", type=int, default=12, help="steps per window")
    ap.add_argument("--top", type=int, default=8, help="gap pairs listed per window")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("fp8",))
    ap.add_argument("--warmup", action="store_true", help="run the workload once untimed first (plans, compiles)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-traces", default=None, help="write each window's chrome trace here (w<step>.json)")
    args = ap.parse_args()
    write_json(args.json, run(args) | provenance("python bench/decode_timeline.py " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
