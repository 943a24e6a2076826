"""bench/decode_timeline.py's accounting of a device trace: busy time is the union of the GPU
intervals (overlaps counted once), idle gaps are named by the kernels around them, host events
are not device time."""
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "decode_timeline", Path(__file__).resolve().parents[1] / "bench" / "decode_timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


def test_overlapping_intervals_count_once_and_gaps_name_their_neighbours():
    intervals = [(0, 10, "a", 1), (5, 12, "b", 2), (20, 30, "c", 3), (30.5, 40, "d", 4), (50, 51, "e", 5)]
    busy, span, gaps = timeline.busy_and_gaps(intervals)
    assert (busy, span) == (12 + 10 + 9.5 + 1, 51)
    assert gaps == [(8, "b", "c", 12, 3), (10, "d", "e", 40, 5)]  # the 0.5 us gap is under min_gap_us


def test_a_trace_summary_per_step(tmp_path):
    """Busy / span / idle over the whole window; gaps from the second step's input copy on (the first step
    refills the pipeline after the window's synchronize), each host-late where the op after it was issued
    after the device went idle."""
    def op(cat, ts, dur, name, corr):
        return dict(ph="X", cat=cat, ts=ts, dur=dur, name=name, args=dict(correlation=corr))

    events = [op("gpu_memcpy", 0, 2, "Memcpy HtoD", 1),         # step 1's inputs
              op("kernel", 10, 10, "void gemm(int)", 2),         # 8 us gap: first step, not counted
              op("gpu_memcpy", 24, 2, "Memcpy HtoD", 3),         # step 2's inputs; 4 us gap before: not counted
              op("kernel", 40, 10, "attention", 4),              # 14 us gap, issued at 30 > 26: host-late
              op("kernel", 53, 2, "sample", 5),                  # 3 us gap, issued at 20: device latency
              dict(ph="X", cat="cpu_op", ts=0, dur=1000, name="aten::mm"),  # host: not device time
              op("cuda_runtime", 5, 1, "cudaMemcpyAsync", 3), op("cuda_runtime", 30, 2, "cudaLaunchKernel", 4),
              op("cuda_runtime", 20, 2, "cudaLaunchKernel", 5)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = timeline.summarize(str(path), steps=3, wall_s=0.00015, batch_sizes=[4, 6], top=5)
    assert s["gpu_busy_ms_per_step"] == 0.0087 and s["gpu_span_ms_per_step"] == 0.0183
    assert s["idle_ms_per_step"] == 0.0097 and s["wall_ms_per_step"] == 0.05 and s["mean_batch"] == 5.0
    assert [(g["before"], g["after"], g["count"]) for g in s["gaps"]] == [("Memcpy HtoD", "attention", 1),
                                                                          ("attention", "sample", 1)]
    assert [g["host_late_ms_per_step"] for g in s["gaps"]] == [0.007, 0.0]  # 14 us over the 2 steps counted
    assert s["steady_gap_ms_per_step"] == 0.0085 and s["steady_host_late_ms_per_step"] == 0.007
    # kernels by total device time: the two 10 us kernels, then the two 2 us copies (one name), then sample
    assert [(k["name"], k["calls"], k["ms_per_step"]) for k in s["kernels"]] == [
        ("gemm", 1, 0.0033), ("attention", 1, 0.0033), ("Memcpy HtoD", 2, 0.0013), ("sample", 1, 0.0007)]
    assert [k["share"] for k in s["kernels"]] == [0.385, 0.385, 0.154, 0.077]  # of 26 us


def test_step_mix_buckets_steps_by_kind_with_their_tokens():
    from types import SimpleNamespace as NS

    def batch(prefill, *scheduled):
        return NS(is_prefill=prefill, seqs=[NS(num_scheduled_tokens=n) for n in scheduled])

    mix = timeline.StepMix()
    mix.stepped(5.0)  # before any launch: not counted
    for b, seconds in ((batch(True, 100, 50), 0.3), (batch(False, *[1] * 40), 0.1), (batch(False, *[1] * 300), 0.6)):
        mix.launched(b)
        mix.stepped(seconds)
    got = mix.summary()
    assert got["prefill"] == dict(steps=1, tokens=150, seconds=0.3, share=0.3)
    assert got["decode <=64"]["tokens"] == 40 and got["decode >256"]["share"] == 0.6
    assert timeline.step_kind(batch(False, 1)) == "decode <=32"
