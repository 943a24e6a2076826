"""CUDA-graph capture of one forward per batch bucket, every graph in one memory pool.

The decode step (``model_runner.py``), the speculative verify step (``spec/verify_step.py``) and
the draft model's round (``spec/draft_model.py``) each capture a graph per batch size over
static input buffers sliced to ``[:bs]``. They share the capture loop below, which keeps two
invariants:

- the largest batch is captured first and every later graph (smaller buckets, other step
  variants) allocates from the first graph's pool: a bucket replays inside memory the largest
  one already reserved, so N buckets cost about one bucket's activations, not N;
- each forward runs once eagerly before its capture (Triton compiles and autotunes, the caching
  allocator settles), because neither may happen inside a capture; the device is synchronized
  after each graph so a failure names its bucket.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch


def current_capture_stream() -> Optional[torch.cuda.Stream]:
    """The calling thread's current stream when it can capture (an engine with a stream of its own,
    ``EngineConfig.stream_priority``: the stream it replays on), else None: the default stream cannot
    capture, and ``torch.cuda.graph`` then uses its side stream."""
    current = torch.cuda.current_stream()
    return None if current == torch.cuda.default_stream() else current


def capture_graphs(sizes: Iterable[int], *steps: Callable[[int], None],
                   stream: Optional[torch.cuda.Stream] = None,
                   before_warmup: Optional[Callable[[int], None]] = None) -> list[dict[int, torch.cuda.CUDAGraph]]:
    """One graph per (batch size, step), largest size first, all in one memory pool.

    ``step(bs)`` runs the forward of ``bs`` rows on the static buffers (writing its outputs
    into them); it is called twice per size, once eagerly (warm-up), once under capture.
    ``stream``: capture on it (:func:`current_capture_stream`). ``before_warmup(bs)``: runs
    before each eager warm-up, e.g. to give buffers that several buckets share valid inputs of
    bucket ``bs`` (the warm-up executes its kernels; a capture does not). Returns, per step in the order
    given, ``{bs: graph}``. Call under ``torch.inference_mode``
    when the graphs will replay inference.
    """
    graphs: list[dict[int, torch.cuda.CUDAGraph]] = [{} for _ in steps]
    pool = None
    on_stream = {} if stream is None else {"stream": stream}  # None: torch.cuda.graph's side stream
    for bs in sorted(set(sizes), reverse=True):
        for step, captured in zip(steps, graphs):
            if before_warmup is not None:
                before_warmup(bs)
            step(bs)  # warm-up (Triton compile, allocator)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool, **on_stream):
                step(bs)
            pool = graph.pool() if pool is None else pool
            captured[bs] = graph
            torch.cuda.synchronize()
    return graphs
