"""What one speculative catch-up costs (issue 23): per catch-up step, its wall time and positions.

Under the adaptive gate (spec/adaptive.py) a sampled tail decodes mostly plain and probes
speculation now and then; each probe's first speculative step first catches the proposer up on
the positions decoded plain (the draft model's K/V prefill; the EAGLE head's entries, which
until 2026-12-04 also needed a target forward for their features: the runner records them now).
On the H200 those catch-ups cost 45 ms (draft model) and 99 ms (EAGLE) each at T = 1
(bench/RESULTS.md, 2026-12-04), and EAGLE's ~50 ms even for ~90 positions. This bench times every
catch-up step of a random-weight target (the cost does not depend on acceptance) with the engine's
compiled glue on and off (``ASYNCRL_ENGINE_COMPILE``), each in its own process, so a per-shape
compile shows as a cost that does not shrink with the positions.

    python bench/spec_catch_up.py --json out.json            # one GPU, ~2-3 min
    python bench/spec_catch_up.py --tiny                     # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from spec_trained_target import DRAFT_SHAPES, engine_kwargs  # noqa: E402  (the trained-target run's draft and engine)

from asyncrl.engine.bench import SHAPES, build_random_hf  # noqa: E402


def build_models(shape: str, device: str, out: Path) -> dict:
    """A random target, a random 2-layer draft model of its vocabulary and a random EAGLE head, saved."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncrl.engine.models.config import ModelConfig
    from asyncrl.engine.spec.eagle_head import new_head
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    build_random_hf(shape, dtype, device, 4096).save_pretrained(out / "target")
    vocab = SHAPES[shape]["vocab_size"]
    cfg = Qwen3Config(max_position_embeddings=4096, eos_token_id=0, pad_token_id=0, bos_token_id=0,
                      **{**DRAFT_SHAPES[shape], "vocab_size": vocab})
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(out / "draft")
    new_head(ModelConfig.from_dir(str(out / "target")), seed=1).save(str(out / "head"))
    return {"target": str(out / "target"), "draft_model": str(out / "draft"), "eagle": str(out / "head")}


def time_catch_ups(paths: dict, method: str, device: str, batch: int, tokens: int) -> dict:
    """One engine, the gate on, a sampled tail of ``batch`` x ``tokens``: every catch-up step's seconds."""
    from asyncrl.engine.llm import LLM
    from asyncrl.types import SamplingParams
    spec = {"method": method, "model": paths[method], "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    llm = LLM(paths["target"], speculative_config=spec, **engine_kwargs(dtype, device, tokens + 64))
    steps: list[dict] = []
    inner = llm.spec.step

    def timed_step(scheduler, version):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(scheduler, version)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        n = int(getattr(llm.spec.proposer, "catch_up_tokens", 0))
        steps.append({"catch_up_tokens": n, "seconds": time.perf_counter() - t0})
        return out

    llm.spec.step = timed_step
    prompts = [list(range(1 + i, 33 + i)) for i in range(batch)]
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate(prompts, params)  # warm-up (compiles, graphs)
    steps.clear()
    llm.spec.gate.reset()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    total = time.perf_counter() - t0
    catch = [s for s in steps if s["catch_up_tokens"]]
    plain_spec = [s["seconds"] for s in steps if not s["catch_up_tokens"]]
    llm.close()
    return dict(method=method, compile=os.environ.get("ASYNCRL_ENGINE_COMPILE", "1"), total_s=round(total, 3),
                catch_ups=[{"tokens": s["catch_up_tokens"], "ms": round(s["seconds"] * 1e3, 2)} for s in catch],
                spec_step_ms_median=round(sorted(plain_spec)[len(plain_spec) // 2] * 1e3, 2) if plain_spec else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shape)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # method:models_dir, run in a subprocess
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.batch, args.tokens = 2, 24
    if args.child:
        method, models = args.child.split(":", 1)
        paths = json.loads(Path(models, "paths.json").read_text())
        print(json.dumps(time_catch_ups(paths, method, device, args.batch, args.tokens)), flush=True)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="spec_catch_up_") as tmp:
        paths = build_models("tiny" if args.tiny else "qwen3-0.6b", device, Path(tmp))
        Path(tmp, "paths.json").write_text(json.dumps(paths))
        for method in ("draft_model", "eagle"):
            for compile_glue in ("1", "0"):
                env = {**os.environ, "ASYNCRL_ENGINE_COMPILE": compile_glue}
                cmd = [sys.executable, __file__, "--child", f"{method}:{tmp}", "--batch", str(args.batch),
                       "--tokens", str(args.tokens)] + (["--tiny"] if args.tiny else [])
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    rows.append(dict(method=method, compile=compile_glue, error=proc.stderr[-2000:]))
                else:
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, batch=args.batch, tokens=args.tokens, rows=rows),
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
