"""Host-only cost of one engine decode step (no model, no device): schedule, input arrays,
sampling arrays, postprocess, at a given batch and context, with the real Scheduler,
BlockManager and ModelRunner input builders. This is the work overlapped scheduling must
hide behind the device's step time (ENGINE.md §6.4).

    python bench/engine_host_step.py --batch 512 --prompt 1024 --steps 200
"""
import argparse
import gc
import json
import statistics
import time
import types

import numpy as np

from asyncrl.engine.block_manager import BlockManager
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.model_runner import ModelRunner
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.sequence import Sequence
from asyncrl.types import SamplingParams


def measure(batch: int, prompt: int, steps: int, block: int = 64, max_len: int = 4096) -> dict:
    width = max_len // block
    bm = BlockManager(batch * ((prompt + steps) // block + 2), block, max_blocks_per_seq=width)
    sc = Scheduler(EngineConfig(block_size=block, max_num_seqs=batch), bm, max_len, [0])
    params = SamplingParams(temperature=1.0, max_tokens=steps + 10, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(batch):
        sc.add(Sequence(rng.integers(1, 1000, prompt).tolist(), params, str(i), 0, i))
    runner = types.SimpleNamespace(block_size=block, scratch_block=len(bm.blocks), _bt_width=lambda: width,
                                   _keys_of=None, _uniform_of=None)
    runner._sequence_keys = ModelRunner._sequence_keys.__get__(runner)
    b = sc.schedule()
    while b.is_prefill:
        sc.postprocess(b, [1] * len(b.sample_seqs), [0.0] * len(b.sample_seqs), 0)
        b = sc.schedule()
    phases = {k: [] for k in ("schedule", "inputs", "sample_arrays", "postprocess")}
    for step in range(steps):
        t0 = time.perf_counter()
        if step:
            b = sc.schedule()
        t1 = time.perf_counter()
        ModelRunner._decode_paged_inputs(runner, b, len(b.seqs))
        t2 = time.perf_counter()
        ModelRunner._sample_arrays(runner, b)
        t3 = time.perf_counter()
        sc.postprocess(b, [5] * len(b.sample_seqs), [0.0] * len(b.sample_seqs), 0)
        t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(v)
    med = {k: round(statistics.median(v) * 1000, 3) for k, v in phases.items()}
    return dict(batch=batch, prompt=prompt, steps=steps, ms_median=med, ms_total=round(sum(med.values()), 3))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while measuring")
    a = ap.parse_args()
    if a.no_gc:
        gc.disable()
    print(json.dumps(measure(a.batch, a.prompt, a.steps)))
