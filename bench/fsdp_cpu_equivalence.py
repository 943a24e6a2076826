"""How close the FSDP2 trainer on N gloo ranks comes to one process: the largest difference per
case at N = 2 and 4 (the tests in tests/distributed/ assert <= 1e-6; this prints the values).

    python bench/fsdp_cpu_equivalence.py          # ~1 min on 2 CPU cores
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.distributed import cases  # noqa: E402  (the cases the tests run)
from tests.distributed.ranks import run_ranks  # noqa: E402


def max_diff(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def max_settled_diff(got: dict, want: dict, grads: dict) -> float:
    """Max |Δ weight| where the gradient is >= 100·ε of Adam (outside its noise amplification)."""
    diffs = [(got[k] - want[k]).abs()[grads[k].abs() >= cases.INSENSITIVE_GRAD] for k in want]
    return max(d.max().item() for d in diffs if d.numel())


def main() -> int:
    single = {name: cases.run_case(name, sharded=False) for name in cases.CASES}
    out = Path(tempfile.mkdtemp(prefix="fsdp-eq-"))
    print("| case | ranks | loss (one process) | Δ loss | max Δ gradient | max Δ weight (|g| >= 1e-6) | "
          "max Δ weight (all) | max Δ log-prob |")
    print("|---|---|---|---|---|---|---|---|")
    for world in (2, 4):
        run_ranks(world, out, cases.rank_main, str(out), str(out / "ckpt"), world > 2)
        results = torch.load(out / f"world{world}.pt", weights_only=False)
        for name in (cases.FOUR_RANK_CASES if world > 2 else cases.CASES):
            got, want = results[name], single[name]
            loss = want["metrics"]["actor/pg_loss"]
            print(f"| {name} | {world} | {loss:.6f} | {abs(got['metrics']['actor/pg_loss'] - loss):.1e} | "
                  f"{max_diff(got['grads'], want['grads']):.1e} | "
                  f"{max_settled_diff(got['weights'], want['weights'], want['grads']):.1e} | "
                  f"{max_diff(got['weights'], want['weights']):.1e} | "
                  f"{(got['logprobs'] - want['logprobs']).abs().max().item():.1e} |")
        if world == 2:
            written = results["checkpoint"]
        else:
            resumed = {"4 ranks": results["resume"], "1 process": cases.resume_checkpoint(out / "ckpt", False)}
    print("\ncheckpoint written by 2 ranks after step 1; step 2 resumed elsewhere vs step 2 uninterrupted:")
    want = written["metrics"]["actor/pg_loss"]
    for where, got in resumed.items():
        print(f"  {where}: loss {got['metrics']['actor/pg_loss']:.9f} vs {want:.9f} "
              f"(Δ {abs(got['metrics']['actor/pg_loss'] - want):.1e}), max Δ weight "
              f"{max_diff(got['weights'], written['weights']):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
