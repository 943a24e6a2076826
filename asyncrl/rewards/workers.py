"""Runners: where one reward call executes, and how a hung call is stopped.

``RewardPool`` owns ``num_workers`` slot threads; each slot owns one runner and runs
one call at a time through ``runner.call(name, prompt, response, fields, timeout_s)``,
which returns a ``CallOutcome`` and never raises.

  * ``InlineRunner``: calls the function in the slot's thread. No isolation and no
    timeout; for cheap, trusted rewards (format checks, synthetic tasks).
  * ``ThreadRunner``: a fresh daemon thread per call, joined with the timeout. A hung
    call is abandoned (Python threads cannot be killed): it keeps its CPU and memory
    until it returns, but the slot moves on, so the pool is never wedged.
  * ``ProcessRunner``: a long-lived child process per slot. A call that passes its
    timeout gets the child killed and replaced; a child that dies (segfault,
    ``os._exit``, OOM kill) is replaced too. This is the only mode that truly stops
    a hung reward.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import multiprocessing
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from asyncrl.rewards.registry import resolve_reward

# (name, fn or "module:function", bound keyword arguments) for every component.
WorkerSpec = tuple[str, Any, dict]


@dataclass
class CallOutcome:
    """What one reward call produced. ``status`` is "ok", "error" or "timeout"."""

    status: str
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def build_functions(specs: list[WorkerSpec]) -> dict[str, Callable]:
    """Resolve every spec to a callable with its keyword arguments bound."""
    return {
        name: functools.partial(resolve_reward(fn), **kwargs) if kwargs else resolve_reward(fn)
        for name, fn, kwargs in specs
    }


def _describe(err: BaseException) -> str:
    """``Type: message`` plus the innermost frame, enough to find the bug in a log."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def invoke(fns: dict[str, Callable], name: str, prompt, response, fields, batched: bool = False) -> CallOutcome:
    """Run one reward call and capture anything it raises (SystemExit included).

    A batched reward takes lists: ``fn(prompts, responses, fields_list) -> scores``.
    An ``async def`` reward is run to completion here (its own event loop).
    """
    start = time.perf_counter()
    try:
        value = fns[name](prompt, response, fields) if batched else fns[name](prompt, response, **fields)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
        return CallOutcome("ok", value, seconds=time.perf_counter() - start)
    except BaseException as err:  # a reward calling sys.exit() must not end the slot
        return CallOutcome("error", error=_describe(err), seconds=time.perf_counter() - start)


class InlineRunner:
    """Calls in the current thread; ``timeout_s`` is not enforced."""

    def __init__(self, specs: list[WorkerSpec]):
        self.fns = build_functions(specs)

    def call(self, name, prompt, response, fields, timeout_s, batched=False) -> CallOutcome:
        return invoke(self.fns, name, prompt, response, fields, batched)

    def close(self) -> None:
        pass


class ThreadRunner:
    """One daemon thread per call; a call past its timeout is abandoned."""

    def __init__(self, specs: list[WorkerSpec]):
        self.fns = build_functions(specs)
        self.abandoned = 0

    def call(self, name, prompt, response, fields, timeout_s, batched=False) -> CallOutcome:
        box: list[CallOutcome] = []
        thread = threading.Thread(
            target=lambda: box.append(invoke(self.fns, name, prompt, response, fields, batched)),
            name=f"reward-{name}", daemon=True,
        )
        start = time.perf_counter()
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self.abandoned += 1
            return CallOutcome("timeout", error=f"timed out after {timeout_s:g} s (thread abandoned)",
                               seconds=time.perf_counter() - start)
        return box[0]

    def close(self) -> None:
        pass


def _process_main(conn, specs: list[WorkerSpec]) -> None:
    """Child loop: receive (name, prompt, response, fields, batched), send a CallOutcome.

    SIGINT/SIGTERM are ignored: a Ctrl-C reaches the whole process group, and the trainer
    stops its workers itself (no KeyboardInterrupt traceback from here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fns = build_functions(specs)
    except BaseException as err:
        conn.send(CallOutcome("error", error=f"worker could not resolve rewards: {_describe(err)}"))
        return
    conn.send(CallOutcome("ok", "ready"))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        outcome = invoke(fns, *message)
        try:
            conn.send(outcome)
        except Exception as err:  # an unpicklable return value
            conn.send(CallOutcome("error", error=f"reward returned an unsendable value: {_describe(err)}"))


@functools.lru_cache(maxsize=None)
def _context(method: str):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # The fork server imports asyncrl (and torch) once; every worker, including a
        # replacement for a killed one, is then forked from it in milliseconds.
        ctx.set_forkserver_preload(["asyncrl.rewards.workers"])
    return ctx


class ProcessRunner:
    """A child process that runs calls; killed and restarted on timeout or death."""

    def __init__(self, specs: list[WorkerSpec], start_method: str = "forkserver",
                 start_timeout_s: float = 120.0):
        self.specs = specs
        self.start_method = start_method
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.process: Optional[multiprocessing.Process] = None
        self.conn = None
        self._start()

    def _start(self) -> None:
        ctx = _context(self.start_method)
        parent_conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_process_main, args=(child_conn, self.specs), daemon=True)
        self.process.start()
        child_conn.close()
        self.conn = parent_conn
        if not parent_conn.poll(self.start_timeout_s):
            self._kill()
            raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:g} s")
        try:
            ready = parent_conn.recv()
        except EOFError:
            self._kill()
            raise RuntimeError(
                "reward worker exited while starting. If you run a script, create the "
                "RewardPool under `if __name__ == '__main__':` (workers re-import __main__), "
                "or use mode='thread'/'inline'."
            ) from None
        if ready.status != "ok":
            self._kill()
            raise RuntimeError(ready.error)

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        if self.process is not None:
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.process, self.conn = None, None

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def call(self, name, prompt, response, fields, timeout_s, batched=False) -> CallOutcome:
        start = time.perf_counter()
        try:
            self.conn.send((name, prompt, response, fields, batched))
            if not self.conn.poll(timeout_s):
                self._restart()
                return CallOutcome("timeout", error=f"timed out after {timeout_s:g} s (worker killed)",
                                   seconds=time.perf_counter() - start)
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as err:
            code = None
            if self.process is not None:
                self.process.join(1)  # let the exit code arrive
                code = self.process.exitcode
            self._restart()
            return CallOutcome("error", error=f"reward worker died (exit code {code}): {type(err).__name__}",
                               seconds=time.perf_counter() - start)
        except Exception as err:  # fields that cannot be pickled, for instance
            return CallOutcome("error", error=f"could not send the call to the worker: {_describe(err)}",
                               seconds=time.perf_counter() - start)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            if self.process is not None:
                self.process.join(2)
        self._kill()
