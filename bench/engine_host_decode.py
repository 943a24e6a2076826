"""The engine's host work per decode step at the GRPO rollout's shape (issue 20: the rollout is host-bound).

    python bench/engine_host_decode.py [--repeats 3] [--profile 25]      # CPU
    python bench/engine_host_decode.py --device cuda [--repeats 3]       # GPU, ~1 min

16 prompts x 8 samples x (256 + 256) tokens, ignore_eos, block size 64, batch 128, max_model_len 4096,
overlapped scheduling, cascade planning, through the real ``LLM`` (scheduler, block manager, step gate,
``ModelRunner.prepare`` / ``execute``, staging, read-back).

CPU: a 1-layer Qwen3 with Qwen3-0.6B's head layout (16 q / 8 kv heads: the same cascade tile shape)
and a 64-token vocabulary. The engine's CPU branches (gathered attention, no cascade) are switched
onto the CUDA decode path's host logic: ``prepare`` builds the paged-decode arrays and the cascade
plan (a ``CascadeBuffers`` on the CPU), ``forward`` of a paged step does its host work (pending-id
resolution, the plan's buffer copy) and returns zero hidden states instead of the Triton decode; the
LM head and the sampler run on the CPU (their math is device work on a GPU); prefills run the model.
GPU (``--device cuda``): Qwen3-0.6B-shaped random bf16 weights with the engine's GPU defaults, two
engines (``decode_graph_sampler`` off and on), and per variant also CUDA events around each step's
``execute``: the stream's idle gap between steps (the device waiting for the host) and its busy time.

Variants, interleaved in the one process: cascade plan reuse on / off (``CascadeBuffers.reuse``), x
(GPU) the sampling decode graph off / on. Prints one JSON object: wall (and this thread's CPU) ms
per decode step, median over decode steps 3.. of each rollout, median of ``--repeats`` rollouts;
the whole rollout's seconds (prefill and read-back included: the trainer's rollout stage);
whether the tokens equal the first variant's; per variant the median ms of each host phase
(perf_counter around the engine's methods; "fetch" includes waiting for the device; GPU: the graph
launch alone); with ``--profile N`` the top N functions of a cProfile'd rollout by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from typing import Optional

import torch

from asyncrl.engine import LLM
from asyncrl.engine.cascade import CascadeBuffers
from asyncrl.types import SamplingParams

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, BLOCK = 16, 8, 256, 256, 64
MAX_MODEL_LEN = 4096  # as ``asyncrl bench rollout`` on a GPU: 64 block-table columns


def tiny_qwen3(vocab: int):
    """A 1-layer Qwen3 with Qwen3-0.6B's head layout (16 q / 8 kv heads) and a small hidden size."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=MAX_MODEL_LEN, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0,
                      bos_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def cuda_path_engine(hf) -> LLM:
    """An ``LLM`` on the CPU whose runner takes the CUDA decode path's host logic (module doc)."""
    llm = LLM(hf, device="cpu", block_size=BLOCK, async_scheduling=True, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=PROMPTS * SAMPLES * 10)
    runner = llm.runner
    runner.cascade = CascadeBuffers(runner.num_heads, runner.num_kv_heads, runner.block_size,
                                    llm.config.max_num_seqs, runner.device)
    real_forward, hidden = runner.forward, hf.config.hidden_size

    def forward(step, inputs):
        if not step.paged_rows:
            return real_forward(step, inputs)
        ids, pos, slots, src, bt, ctx, *rest = inputs
        # (``pending_all`` is absent before issue 20's change: the harness also times older code)
        runner._resolve_ids(ids, src, step.max_src, *([step.pending_all] if hasattr(step, "pending_all") else []))
        runner._cascade_meta(rest[step.num_state:], step.paged_rows)
        return torch.zeros(step.real_rows, hidden)

    runner.forward = forward
    runner.is_cuda = True  # prepare: paged decode inputs + cascade plan (read nowhere else after the build)
    return llm


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(1, vocab, (PROMPTS, PROMPT_TOKENS), generator=g).tolist()


def rollout(llm: LLM, vocab: int, profiler=None, cpu: Optional[list] = None) -> tuple[list[float], list]:
    """One GRPO-shaped rollout driven step by step; (wall seconds of each decode step after the
    first two, outputs). ``cpu``: also collect each such step's CPU time of this thread (less
    sensitive than wall time to other processes on a shared machine)."""
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
    llm.block_manager.set_namespace(llm.block_manager.namespace + 1)  # no prefix-cache hits across runs
    ids = [llm.add_request(p, params) for p in prompts(vocab)]
    times, first = [], llm.num_decode_steps
    while llm.has_unfinished():
        before = llm.num_decode_steps
        warm = before - first >= 2
        c0, t0 = time.thread_time(), time.perf_counter()
        if profiler is not None and warm:
            profiler.enable()
            llm.step()
            profiler.disable()
        else:
            llm.step()
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if llm.num_decode_steps > before and warm:
            times.append(dt)
            if cpu is not None:
                cpu.append(dc)
    return times, [llm.pop_output(r) for r in ids]


def phase_timers(llm: LLM) -> tuple[dict, list]:
    """Wrap the engine's phases with perf_counter timers (instance attributes); returns ({phase:
    [seconds, ...]} filled as the engine runs, what ``untime`` needs to put the methods back)."""
    runner, sc = llm.runner, llm.scheduler
    targets = [("schedule", sc, "schedule"), ("launch: prepare", runner, "prepare"),
               ("  paged inputs", runner, "_decode_paged_inputs"), ("  cascade plan", runner, "_cascade_plan"),
               ("  sampling arrays", runner, "_sample_arrays"), ("launch: execute", runner, "execute"),
               ("  host->device staging", runner.h2d, "put"), ("  forward (host part)", runner, "forward"),
               ("  LM head + sampler", runner, "sample"), ("  token copy start", runner.d2h, "start"),
               ("fetch", runner, "fetch"), ("postprocess", sc, "postprocess")]
    spent, saved = {}, []
    for label, obj, name in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, vars(obj).get(name)))
        spent[label] = acc = []

        def timed(*args, _fn=fn, _acc=acc, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                _acc.append(time.perf_counter() - t0)
        setattr(obj, name, timed)
    if runner.graphs:  # CUDA: the graph launches alone (inside "forward")
        acc = spent["    graph replay"] = []
        for graphs in [runner.graphs, runner.cascade_graphs, *getattr(runner, "sampling_graphs", {}).values()]:
            for bs, graph in list(graphs.items()):
                graphs[bs] = TimedGraph(graph, acc)
                saved.append((graphs, bs, graph))
    return spent, saved


class TimedGraph:
    """A CUDA graph whose ``replay`` (the host's launch of it) is timed into ``acc``."""

    def __init__(self, graph, acc: list):
        self.graph, self.acc = graph, acc

    def replay(self) -> None:
        t0 = time.perf_counter()
        self.graph.replay()
        self.acc.append(time.perf_counter() - t0)


def untime(saved: list) -> None:
    for obj, name, own in reversed(saved):
        if isinstance(obj, dict):  # a timed graph back in its bucket
            obj[name] = own
        elif own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def breakdown(llm: LLM, vocab: int) -> dict:
    """Median ms per decode step of each phase over one rollout (the prefill step's calls dropped:
    each phase's list is cut to its last ``decode steps`` entries, one call per step)."""
    spent, saved = phase_timers(llm)
    try:
        times, _ = rollout(llm, vocab)
    finally:
        untime(saved)
    out = {}
    for label, xs in spent.items():
        xs = xs[-len(times):]
        out[label] = round(statistics.median(xs) * 1e3, 4) if xs else None
    out["LLM.step (timed)"] = round(statistics.median(times) * 1e3, 4)
    return out


def cprofile(llm: LLM, vocab: int, top: int) -> dict:
    prof = cProfile.Profile()
    times, _ = rollout(llm, vocab, prof)
    stats = pstats.Stats(prof)
    own = sorted(((tt, f"{file.split('asyncrl/')[-1]}:{name}") for (file, _, name), (_, _, tt, _, _)
                  in stats.stats.items()), reverse=True)[:top]
    return {name: round(tt / len(times) * 1e3, 4) for tt, name in own}


def gpu_engine(graph_sampler: bool) -> LLM:
    """The GRPO rollout's engine on CUDA: qwen3-0.6b-shaped random bf16 weights, the engine's GPU
    defaults (CUDA graphs, cascade decode, fused K/V write, overlapped scheduling), max_model_len
    4096 as ``asyncrl bench rollout``; graph buckets up to the batch (128) and a KV pool of 10 blocks
    per row (9.2 GiB), so two engines fit. ``graph_sampler``: ``decode_graph_sampler``."""
    from asyncrl.engine.bench import build_random_hf

    hf = build_random_hf("qwen3-0.6b", torch.bfloat16, "cuda", MAX_MODEL_LEN)
    return LLM(hf, dtype=torch.bfloat16, device="cuda", block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=PROMPTS * SAMPLES, num_kv_blocks=PROMPTS * SAMPLES * 10,
               decode_graph_sampler=graph_sampler)


def device_gaps(llm: LLM, vocab: int) -> dict:
    """CUDA events on the engine's stream at the start and end of each decode step's ``execute``
    (one rollout): ``gap`` = the stream's idle time between a step's end and the next step's start
    (the device waiting for the host), ``busy`` = start to end of a step (its device time, plus any
    wait for the host's launches inside the step); means and medians in ms over consecutive decode
    steps after the first two."""
    runner = llm.runner
    real, marks = runner.execute, []

    def execute(step):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(step)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks.append((start, end, bool(step.paged_rows)))
        return out

    runner.execute = execute
    try:
        times, _ = rollout(llm, vocab)
    finally:
        del runner.execute
    torch.cuda.synchronize()
    decode = [i for i, m in enumerate(marks) if m[2]][2:]
    busy = [marks[i][0].elapsed_time(marks[i][1]) for i in decode]
    gap = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in decode if i + 1 < len(marks) and marks[i + 1][2]]
    r = lambda x: round(x, 4)  # noqa: E731
    return dict(busy_mean=r(statistics.mean(busy)), busy_median=r(statistics.median(busy)),
                gap_mean=r(statistics.mean(gap)), gap_median=r(statistics.median(gap)),
                step_wall_median=r(statistics.median(times) * 1e3), decode_steps=len(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: the tiny model on the CUDA decode path's host logic; cuda: the real GPU engine")
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per variant (interleaved)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile one rollout; print the top N functions")
    ap.add_argument("--no-phases", action="store_true", help="only the per-step times (no phase breakdown)")
    ap.add_argument("--vocab", type=int, default=64, help="CPU: small, so the CPU sampler's [128, V] math stays cheap")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    errors = {}
    if cuda:  # two engines: the decode graph without and with the sampler inside (decode_graph_sampler)
        engines = {}
        for name, on in (("graph_sampler_off", False), ("graph_sampler_on", True)):
            try:  # a failing variant is reported, and the others still measured
                engines[name] = gpu_engine(on)
                vocab = engines[name].model.config.vocab_size
                rollout(engines[name], vocab)  # warm-up (compiles, allocator, first-run plans)
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {e}"
                engines.pop(name, None)
                torch.cuda.empty_cache()
    else:
        torch.set_num_threads(1)
        engines, vocab = {"cpu": cuda_path_engine(tiny_qwen3(a.vocab))}, a.vocab
        rollout(engines["cpu"], vocab)  # warm-up
    variants = {f"{e}+{'plan_reuse' if reuse else 'no_plan_reuse'}".replace("cpu+", ""): (e, reuse)
                for e in engines for reuse in (True, False)}
    walls, means, cpus, totals = ({k: [] for k in variants} for _ in range(4))
    tokens = {}
    for _ in range(a.repeats):
        for name, (e, reuse) in variants.items():
            llm = engines[e]
            llm.runner.cascade.reuse = reuse
            cpu, t0 = [], time.perf_counter()
            times, outs = rollout(llm, vocab, cpu=cpu)
            totals[name].append(time.perf_counter() - t0)
            walls[name].append(statistics.median(times) * 1e3)
            means[name].append(statistics.mean(times) * 1e3)
            cpus[name].append(statistics.median(cpu) * 1e3)
            tokens[name] = [c.token_ids for o in outs for c in o.outputs]
    first = next(iter(tokens.values()))
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu (CUDA decode path's host logic)",
                  shape=f"{PROMPTS}x{SAMPLES}x({PROMPT_TOKENS}+{NEW_TOKENS}), block {BLOCK}, batch {PROMPTS * SAMPLES}",
                  ms_per_decode_step_median={k: round(statistics.median(v), 4) for k, v in walls.items()},
                  ms_per_decode_step_mean={k: round(statistics.median(v), 4) for k, v in means.items()},
                  cpu_ms_per_decode_step_median={k: round(statistics.median(v), 4) for k, v in cpus.items()},
                  runs_ms_median={k: [round(x, 4) for x in v] for k, v in walls.items()},
                  rollout_s_median={k: round(statistics.median(v), 4) for k, v in totals.items()},
                  same_tokens_as_first={k: v == first for k, v in tokens.items()},
                  plans_reused={e: getattr(llm.runner.cascade, "plans_reused", None) for e, llm in engines.items()},
                  sampling_graph_steps={e: getattr(llm.runner, "sampling_graph_steps", None)
                                        for e, llm in engines.items()}, errors=errors)
    for name, (e, reuse) in variants.items() if not a.no_phases else ():
        llm = engines[e]
        llm.runner.cascade.reuse = reuse
        result[f"phases_ms_median_{name}"] = breakdown(llm, vocab)
        if cuda:
            result[f"device_ms_{name}"] = device_gaps(llm, vocab)
    if a.profile:
        llm = next(iter(engines.values()))
        llm.runner.cascade.reuse = True
        result["cprofile_own_ms_per_decode_step_top"] = cprofile(llm, vocab, a.profile)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
