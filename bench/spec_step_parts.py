"""Where a speculative step's time goes: runs another bench with every SpeculativeDecoder.step split
into schedule / propose (and the proposer's ``_catch_up`` inside it) / verify / postprocess, each
timed with a device synchronize on both sides, and writes the catch-up steps (and the median of
the others) to ``--out`` at exit. Diagnostic: the syncs cost the overlap the engine normally has,
so read the parts, not the bench's own tok/s, from such a run.

    python bench/spec_step_parts.py --out parts.json bench/spec_trained_target.py --a-batch 0 \\
        --rows off,eagle_adaptive,draft_model_adaptive --temperatures 1.0       # one H200, ~3.5 min
"""
from __future__ import annotations

import argparse
import atexit
import json
import runpy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's asyncrl, without an install
from asyncrl.engine.spec import decoding  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def install(out: str) -> list[dict]:
    """Patch SpeculativeDecoder.step; returns the list it fills (one dict of seconds per step)."""
    records: list[dict] = []
    real_step = decoding.SpeculativeDecoder.step

    def step(self, scheduler, version):
        parts: dict = {}

        def timed(name, fn):
            def wrapped(*a, **kw):
                _sync()
                started = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    _sync()
                    parts[name] = parts.get(name, 0.0) + time.perf_counter() - started
            return wrapped

        patched = [(scheduler, "schedule_verify", "schedule"), (self.proposer, "propose", "propose"),
                   (self.verify_step, "run", "verify"), (scheduler, "postprocess_verify", "postprocess")]
        if hasattr(self.proposer, "_catch_up"):
            patched.append((self.proposer, "_catch_up", "catch_up"))
        for obj, attr, name in patched:  # instance attributes shadow the methods for this step only
            setattr(obj, attr, timed(name, getattr(obj, attr)))
        _sync()
        started = time.perf_counter()
        try:
            return real_step(self, scheduler, version)
        finally:
            _sync()
            parts.update(total=time.perf_counter() - started, proposer=type(self.proposer).__name__,
                         catch_up_tokens=int(getattr(self.proposer, "catch_up_tokens", 0)))
            records.append(parts)
            for obj, attr, _ in patched:
                delattr(obj, attr)

    decoding.SpeculativeDecoder.step = step

    def dump():
        others = sorted(r["total"] for r in records if not r["catch_up_tokens"])
        with open(out, "w") as f:
            json.dump({"steps": len(records), "median_other_step_s": others[len(others) // 2] if others else None,
                       "catch_up_steps": [r for r in records if r["catch_up_tokens"]]}, f, indent=1)
    atexit.register(dump)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("script", help="the bench to run (its own arguments follow)")
    args, rest = ap.parse_known_args()
    install(args.out)
    sys.argv = [args.script, *rest]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
