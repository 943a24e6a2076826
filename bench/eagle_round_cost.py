"""Host cost of one EAGLE round on CPU: what ``EagleProposer.propose`` does OUTSIDE its CUDA graph.

On a GPU a captured graph replays as one launch; what costs host time is everything around it:
aten ops dispatched eagerly (each a kernel launch on the GPU), tensors built from host data
(each a host->device copy, most of them blocking: ``torch.tensor(list, device=...)``,
``from_numpy(...).to(device)``) and reads back to the host. This script runs the engine's GPU
code path on CPU (``proposer.paged = True``; the Triton decode kernel through the interpreter,
so ``TRITON_INTERPRET=1`` is required) with the graph capture replaced by a stand-in whose
replay runs the captured step uncounted, and counts per round, at batch 8 with a tiny target
and the copy head (high acceptance, so rounds look like the steady state):

  ops_outside_graph    aten ops dispatched by propose() outside a replay (GPU: kernel launches)
  host_tensors         tensors built from host data (torch.tensor / from_numpy; a StaticInputs.put
                       counts 1: on the GPU it is one pinned copy) (GPU: host->device copies)
  host_ms              propose() wall time minus the stand-in replays' (CPU, tiny model)
  graph_rounds         rounds that replayed the graph (the rest ran eagerly)

Run it against any checkout to compare (the code under test is whatever ``asyncrl`` imports):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton 3.6> python bench/eagle_round_cost.py
    TRITON_INTERPRET=1 PYTHONPATH=<old checkout>:<triton 3.6> python bench/eagle_round_cost.py
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import asyncrl.engine.spec.eagle as eagle_module
from asyncrl.engine import LLM
from asyncrl.engine.bench import build_random_hf
from asyncrl.types import SamplingParams

STATE = {"count": False, "ops": 0, "host": 0, "replay_s": 0.0}


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if STATE["count"]:
            STATE["ops"] += 1
        return func(*args, **(kwargs or {}))


class _StandInGraph:
    """Replays the captured step eagerly, with counting paused (on the GPU: one graph launch)."""

    def __init__(self, step, bs):
        self.step, self.bs = step, bs

    def replay(self):
        was, STATE["count"] = STATE["count"], False
        t0 = time.perf_counter()
        self.step(self.bs)
        STATE["replay_s"] += time.perf_counter() - t0
        STATE["count"] = was


def _count_host_tensors():
    """Wrap torch.tensor / torch.from_numpy (and StaticInputs.put, as one copy) to count them."""
    def counting(fn):
        def wrapper(*a, **kw):
            if STATE["count"]:
                STATE["host"] += 1
            return fn(*a, **kw)
        return wrapper

    torch.tensor, torch.from_numpy = counting(torch.tensor), counting(torch.from_numpy)
    try:
        from asyncrl.engine.staging import StaticInputs
    except ImportError:
        return
    put = StaticInputs.put

    def one_copy(self, bs, arrays):
        if STATE["count"]:
            STATE["host"] += 1
        was, STATE["count"] = STATE["count"], False
        put(self, bs, arrays)
        STATE["count"] = was
    StaticInputs.put = one_copy


def counted(fn, rounds: list):
    """``fn`` that appends (aten ops, host tensors, host ms without the stand-in replays) per call."""
    def wrapper(*a, **kw):
        STATE.update(count=True, ops=0, host=0, replay_s=0.0)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        dt = time.perf_counter() - t0 - STATE["replay_s"]
        STATE["count"] = False
        rounds.append((STATE["ops"], STATE["host"], 1e3 * dt))
        return out
    return wrapper


def _interpreter_on_numpy_2() -> None:
    """tests/engine/test_triton_decode.py's fix: Triton 3.6's interpreter takes ``int(array)`` of a
    loaded scalar (a loop bound), which numpy >= 2.3 refuses for 1-element arrays."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patch


def round_cost_parser(doc: str) -> argparse.ArgumentParser:
    """The flags both round-cost scripts take (batch rows, drafts per round, new tokens per row)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    return ap


def stand_in_graphs(module) -> None:
    """``module.capture_graphs`` replaced by stand-ins that run each step eagerly (uncounted)."""
    module.capture_graphs = lambda sizes, *steps, **_: [{b: _StandInGraph(s, b) for b in sizes} for s in steps]


def main(argv=None) -> int:
    from spec_eagle import copy_head

    _interpreter_on_numpy_2()
    args = round_cost_parser(__doc__).parse_args(argv)
    hf = build_random_hf("tiny", torch.float32, "cpu", 512)
    head_dir = tempfile.mkdtemp(prefix="eagle_copy_")
    copy_head(hf).save(head_dir)
    stand_in_graphs(eagle_module)
    llm = LLM(hf, device="cpu", dtype=torch.float32, max_model_len=512, block_size=16,
              speculative_config={"method": "eagle", "model": head_dir, "num_speculative_tokens": args.k,
                                  "adaptive": False})  # every step a round
    proposer = llm.spec.proposer
    proposer.paged = True
    proposer._capture([1, 2, 4, 8])
    _count_host_tensors()
    rounds = []
    proposer.propose = counted(proposer.propose, rounds)
    prompts = torch.randint(1, hf.config.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(3))
    with _CountOps():
        llm.generate(prompts.tolist(), SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    steady = rounds[1:]  # round 1 of a sequence builds its features with a target forward (eager on both)
    n = max(len(steady), 1)
    out = dict(batch=args.batch, k=args.k, rounds=len(rounds), first_round=dict(zip(
        ("ops_outside_graph", "host_tensors", "host_ms"), rounds[0])),
        ops_outside_graph=round(sum(r[0] for r in steady) / n, 1), host_tensors=round(sum(r[1] for r in steady) / n, 1),
        host_ms=round(sum(r[2] for r in steady) / n, 3), graph_rounds=getattr(proposer, "rounds", {}).get("graph"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
