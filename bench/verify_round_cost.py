"""Host cost of one speculative verify pass on CPU: what ``VerifyStep.run`` does OUTSIDE its CUDA graph.

On a GPU a captured graph replays as one launch; what costs host time is everything around it:
aten ops dispatched eagerly (each a kernel launch on the GPU), tensors built from host data (each
a host->device copy; a ``StaticInputs.put`` counts 1: one pinned copy) and reads back to the
host. This script runs the verify step's GPU code path on CPU (the runner seen as CUDA by the
verify step only; the paged decode kernel through the Triton interpreter, so
``TRITON_INTERPRET=1`` is required) with the graph capture replaced by a stand-in whose replay
runs the captured step uncounted, and the sampler's one-pass kernel replaced by the torch
sampler it equals (``sample(..., use_filter=False)``: on CPU ~20 ops where the Triton kernel
dispatches ~8, so an eager tail is over-counted by ~12 here). Per round, at batch 8 with a tiny
target and n-gram drafts on repetitive prompts:

  ops_outside_graph    aten ops dispatched by run() outside a replay (GPU: kernel launches)
  host_tensors         tensors built from host data (GPU: host->device copies)
  host_ms              run() wall time minus the stand-in replays' (CPU, tiny model; noisy)
  rounds               how the passes ran (``VerifyStep.rounds`` where the checkout has it)

Run it against any checkout to compare (the code under test is whatever ``asyncrl`` imports):

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:<triton 3.6> python bench/verify_round_cost.py
    TRITON_INTERPRET=1 PYTHONPATH=<old checkout>:$PWD/bench:<triton 3.6> python bench/verify_round_cost.py
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import asyncrl.engine.spec.verify_step as verify_module  # noqa: E402
from eagle_round_cost import (_count_host_tensors, _CountOps, _interpreter_on_numpy_2, counted,  # noqa: E402
                              round_cost_parser, stand_in_graphs)

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.engine.bench import build_random_hf  # noqa: E402
from asyncrl.engine.sampler import sample  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402


class _SeenAsCuda:
    """The runner as the verify step sees it on a GPU: ``is_cuda`` True, everything else the runner's."""

    def __init__(self, runner):
        object.__setattr__(self, "_runner", runner)

    def __getattr__(self, name):
        return True if name == "is_cuda" else getattr(self._runner, name)


def _unfiltered(logits, temperature, keys):
    """What the Triton one-pass kernel computes (``triton_sampler.sample_unfiltered``)."""
    return sample(logits, temperature, torch.zeros_like(keys), torch.ones_like(temperature), keys, use_filter=False)


def main(argv=None) -> int:
    _interpreter_on_numpy_2()
    ap = round_cost_parser(__doc__)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    hf = build_random_hf("tiny", torch.float32, "cpu", 512)
    stand_in_graphs(verify_module)
    llm = LLM(hf, device="cpu", dtype=torch.float32, max_model_len=512, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False})
    step = llm.spec.verify_step
    step.runner = _SeenAsCuda(llm.runner)
    llm.runner.sampler.fast = _unfiltered  # the GPU's unfiltered path (old checkouts call it eagerly)
    if hasattr(step, "tail_sampler"):
        step.tail_sampler, step.tail_in_graph = _unfiltered, verify_module.TAIL_IN_GRAPH
    step._capture([1, 2, 4, 8])
    _count_host_tensors()
    rounds = []
    step.run = counted(step.run, rounds)
    g = torch.Generator().manual_seed(3)
    # repetitive prompts: n-gram drafts most rounds
    prompts = [(torch.randint(1, hf.config.vocab_size, (4,), generator=g).tolist() * 4) for _ in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.tokens, ignore_eos=True)
    with _CountOps():
        llm.generate(prompts, params)
    n = max(len(rounds), 1)
    times = sorted(r[2] for r in rounds)
    out = dict(batch=args.batch, k=args.k, rounds=len(rounds),
               ops_outside_graph=round(sum(r[0] for r in rounds) / n, 1),
               host_tensors=round(sum(r[1] for r in rounds) / n, 1), host_ms_median=round(times[len(times) // 2], 3),
               paths=getattr(step, "rounds", None), accepted=llm.metrics["spec_accepted_tokens"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
