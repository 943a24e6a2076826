"""AsyncEngine: many concurrent asyncio callers, one engine stepped by one thread.

Requests from any number of coroutines (HTTP handlers, agent episodes) are queued into the
same ``LLM``; a single engine thread runs ``LLM.step()`` while any request is live, so all
of them share each decode step (continuous batching), instead of one ``generate`` call per
request run one after another. After each step the thread hands the streaming callers their
new tokens and the callers whose request finished their output, through the caller's own
event loop (``call_soon_threadsafe``). The work per step is O(streaming + finished requests),
not O(live requests): ``LLM.step`` returns the sequences that finished, so the 256 waiting
non-streamed requests of a full decode batch cost nothing until they finish.

Invariant: only the engine thread calls ``LLM.step``, ``add_request`` and ``abort``: callers
queue them (``_pending``) and the thread applies them between two steps, so a caller never
waits for the engine's lock (which a running step holds). ``update_weights`` is the LLM's
thread-safe call (its lock): a weight update lands between two steps and tokens after it carry
the new version.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Optional

import torch

from asyncrl.types import RequestOutput, SamplingParams


@dataclass
class SampleDelta:
    """New tokens of sample ``index`` since the last delta (all lists the same length)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deltas: bool                      # stream per-step deltas, or only the final output
    sent: list[int] = field(default_factory=list)  # tokens already delivered, per sample


_DONE = object()


class AsyncEngine:
    """Drives an ``asyncrl.engine.LLM`` from one background thread for asyncio callers."""

    def __init__(self, llm):
        self.llm = llm
        self._streams: dict[str, _Stream] = {}
        self._streaming: set[str] = set()  # ids in _streams that take per-step deltas
        self._lock = threading.Lock()  # guards _streams and _streaming
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending: collections.deque = collections.deque()  # ("add", id, ids, params) | ("abort", id)

    @property
    def version(self) -> int:
        return self.llm.version

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._streams)

    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncrl-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- callers (any event loop) -------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None) -> RequestOutput:
        """The request's finished output (``params.n`` completions)."""
        async for item in self._submit(prompt_ids, params, request_id, deltas=False):
            if isinstance(item, RequestOutput):
                return item
        raise RuntimeError("engine closed before the request finished")

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: Optional[str] = None) -> AsyncIterator[SampleDelta | RequestOutput]:
        """``SampleDelta``s as tokens are sampled, then the final ``RequestOutput``."""
        async for item in self._submit(prompt_ids, params, request_id, deltas=True):
            yield item

    async def _submit(self, prompt_ids, params, request_id, deltas: bool):
        self._raise_if_dead()
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), deltas, [0] * params.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
            if deltas:
                self._streaming.add(request_id)
        self._pending.append(("add", request_id, list(prompt_ids), params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is _DONE:
                    raise RuntimeError(f"engine stopped: {self._error!r}")
                if isinstance(item, BaseException):  # refused by the engine (e.g. too long for the KV pool)
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput)
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller went away (client disconnect, cancelled episode)
                self._discard(request_id)

    def _discard(self, request_id: str) -> None:
        """A request nobody waits for any more: the engine thread aborts it and drops its output."""
        self._forget(request_id)
        self._pending.append(("abort", request_id))
        self._wake.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                             kv: str = "keep") -> None:
        """Load weights between two engine steps (running requests continue on them)."""
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.llm.update_weights(named_tensors, version, kv=kv))

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_pending()
                if not self.llm.has_unfinished():
                    if not self._pending:
                        self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.llm.step())
        except BaseException as err:  # surfaced to every waiting and later caller
            self._error = err
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
                self._streaming.clear()
            for s in streams:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, _DONE)

    def _apply_pending(self) -> None:
        """Queued additions and aborts, in order (engine thread)."""
        while self._pending:
            op, request_id, *args = self._pending.popleft()
            if op == "abort":
                self.llm.abort([request_id])
                try:
                    if self.llm.request_finished(request_id):
                        self.llm.pop_output(request_id)
                except KeyError:
                    pass  # never added, or already collected
                continue
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:
                continue  # its caller left before it was added
            try:
                self.llm.add_request(*args, request_id)
            except ValueError as err:
                self._forget(request_id)
                self._put(stream, err)

    def _deliver(self, finished) -> None:
        """New tokens to the streaming callers, then each finished request's output to its
        caller. ``finished``: the sequences ``LLM.step`` saw finish (a request is done when
        its last sample finishes, so only their requests need checking)."""
        with self._lock:
            streaming = [(rid, self._streams[rid]) for rid in self._streaming]
        for request_id, stream in streaming:
            try:
                self._push_deltas(request_id, stream)
            except KeyError:  # aborted by its caller meanwhile
                continue
        for request_id in dict.fromkeys(seq.request_id for seq in finished):
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:
                continue  # its caller left (aborted)
            try:
                if not self.llm.request_finished(request_id):
                    continue  # other samples of it still run
                output = self.llm.pop_output(request_id)
            except KeyError:  # aborted by its caller meanwhile
                continue
            self._forget(request_id)
            self._put(stream, output)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._streaming.discard(request_id)

    def _push_deltas(self, request_id: str, stream: _Stream) -> None:
        for seq in self.llm.request_sequences(request_id):
            i, start = seq.sample_index, stream.sent[seq.sample_index]
            ids = seq.completion_token_ids
            if len(ids) > start:
                stream.sent[i] = len(ids)
                self._put(stream, SampleDelta(i, ids[start:], list(seq.logprobs[start:]), list(seq.versions[start:])))

    @staticmethod
    def _put(stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is waiting

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine thread failed: {self._error!r}")
        if self._thread is None:
            self.start()
