"""The async weight sync next to a generating rollout thread, on CPU (issue 20, one-GPU async).

    python bench/async_weight_sync_cpu.py [--pushes 8] [--max-tokens 48]

A tiny random Qwen3 (hidden 64, 2 layers, vocab 1000, fp32) served by the engine in this
process, as the async runtime runs it with ``runtime.rollout_process=false``: a rollout thread
calls ``generate`` back to back (16 prompts x 8 samples x ``--max-tokens`` tokens, ignore_eos),
and the "trainer" (this thread) pushes the weights ``--pushes`` times through the runtime's
``WeightSync`` (in flight, with the log-prob probe), 70 ms apart. Prints per push: the whole
push, and the parts the engine and the probe report (``weight_sync/wait_s``: waiting for the
engine's step in flight; ``load_s``: the copy; ``probe_s``: the probe's generate + trainer
forward; with ``--overlap-probe``, as the runtime now runs the engine in process: the probe's
generate in the background and its comparison, timed as probe_s, 70 ms later before the next
push), and the engine's step time for scale. Without ``--overlap-probe`` it runs against any
checkout (the parts are printed where the code reports them).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=999, pad_token_id=0)
    return Qwen3ForCausalLM(config).eval()


def main():
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.runtime.weight_sync import GenerationGate, LogprobProbe, WeightSync
    from asyncrl.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--overlap-probe", action="store_true",
                    help="as the async runtime runs an in-process engine: the probe's generate in the background, "
                         "its comparison (probe_s) before the next update, not in the push")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    backend = EngineBackend(model, None, dtype=torch.float32, device="cpu")
    params = SamplingParams(n=8, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=True, seed=0)
    prompts = [[i + 1] * 16 for i in range(16)]
    stop, calls = threading.Event(), []

    def rollout():
        while not stop.is_set():
            started = time.perf_counter()
            backend.generate(prompts, params)
            calls.append(time.perf_counter() - started)

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    time.sleep(0.5)
    overlap = {"overlap_probe": True} if args.overlap_probe else {}
    sync = WeightSync(backend, GenerationGate(), LogprobProbe([3, 4, 5], 1.0, 1e-3), inflight=True, **overlap)
    pushes, parts = [], {"weight_sync/wait_s": [], "weight_sync/load_s": [], "weight_sync/probe_s": []}
    try:
        for version in range(1, args.pushes + 1):
            time.sleep(0.07)  # the trainer's next step: its data, its forward ...
            metrics = sync.finish_probe(model) if args.overlap_probe else {}  # ... then before its update
            started = time.perf_counter()
            metrics.update(sync.push(model, version))
            pushes.append(time.perf_counter() - started)
            for key in parts:
                if key in metrics:
                    parts[key].append(metrics[key])
        if args.overlap_probe:
            metrics = sync.finish_probe(model)
            parts["weight_sync/probe_s"].append(metrics["weight_sync/probe_s"])
    finally:
        stop.set()
        thread.join()
    step_s = statistics.median(calls) / args.max_tokens
    print(f"engine step ~{step_s * 1e3:.1f} ms (generate call {statistics.median(calls):.3f} s / {args.max_tokens} steps)")
    print(f"push  median {statistics.median(pushes) * 1e3:.1f} ms  max {max(pushes) * 1e3:.1f} ms  "
          f"all {[round(p * 1e3, 1) for p in pushes]}")
    for key, values in parts.items():
        if values:
            print(f"  {key:22s} median {statistics.median(values) * 1e3:.1f} ms  max {max(values) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
