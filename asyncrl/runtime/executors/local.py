"""The local executor: rollout workers and a watchdog as threads, rewards in a thread pool.

Threads suffice on one machine because the heavy work (torch ops) releases the GIL.
Invariant: an exception in any worker or reward task is kept and re-raised by ``check()``,
which the trainer calls while it waits, so a dead rollout side fails the run instead of
hanging it.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from asyncrl.errors import AsyncRLError
from asyncrl.runtime.executors.rollout_loop import InFlight, RolloutLoop


class LocalExecutor:
    def __init__(self, loop: RolloutLoop, inflight: InFlight, num_workers: int, reward_workers: int,
                 watchdog_period: float = 0.05):
        self.loop, self.inflight, self.num_workers = loop, inflight, num_workers
        self.rewards = ThreadPoolExecutor(reward_workers, thread_name_prefix="asyncrl-reward")
        self.watchdog_period = watchdog_period
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.error: Optional[BaseException] = None

    def start(self) -> None:
        # the watchdog only settles groups past their deadline: none without a time budget
        targets = [self._rollout_worker] * self.num_workers + ([self._watchdog] if self.loop.timeout else [])
        for i, target in enumerate(targets):
            thread = threading.Thread(target=self._guard(target), name=f"asyncrl-rollout-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit_score(self, task: Callable[[], None]) -> None:
        self.rewards.submit(self._guard(task))

    def check(self) -> None:
        if isinstance(self.error, AsyncRLError):  # already names its cause (e.g. the rollout process died)
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"the rollout side failed: {self.error!r}") from self.error

    def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting; in-flight generate calls finish, their groups are never trained."""
        self._stop.set()
        self.loop.staleness.wake()
        for thread in self._threads:
            thread.join(timeout)
        self.rewards.shutdown(wait=False, cancel_futures=True)

    def _rollout_worker(self) -> None:
        while not self._stop.is_set():
            self.loop.run_once()

    def _watchdog(self) -> None:
        while not self._stop.is_set():
            self.inflight.expire(time.perf_counter())
            time.sleep(self.watchdog_period)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run():
            try:
                fn()
            except BaseException as err:  # kept for check(); the trainer re-raises it
                if self.error is None:
                    self.error = err
                self._stop.set()
        return run
