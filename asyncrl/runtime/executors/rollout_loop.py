"""The rollout side of the async runtime: admit -> generate -> score each group as it completes
-> buffer. Executors (local threads, Ray) run ``RolloutLoop.run_once`` in a loop; the logic is
the same whatever runs it.

Groups are tracked from admission to hand-over in ``InFlight``; exactly one of "scored" and
"timed out" settles a group (``settle`` is a compare-and-set), so a late result of a dropped
group is ignored and a group is never both trained and released.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from asyncrl.data.sources import generate_for_examples
from asyncrl.runtime.buffer import RolloutBuffer, ScoredGroup
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.types import Example, RequestOutput, SamplingParams

ScoreFn = Callable[[Example, RequestOutput], tuple[list[float], list[float]]]


@dataclass
class PendingGroup:
    gid: int
    example: Example
    version: int
    deadline: float
    output: Optional[RequestOutput] = None
    scores: dict[int, tuple[float, float]] = field(default_factory=dict)  # completion index -> (score, correct)
    settled: bool = False
    round_index: int = 0


class InFlight:
    """Admitted groups not yet handed over. Invariant: each gid is settled once, either
    accepted into the buffer or released from the staleness manager and the buffer."""

    def __init__(self, staleness: StalenessManager, buffer: RolloutBuffer, policy: str):
        self.staleness, self.buffer, self.policy = staleness, buffer, policy
        self.groups: dict[int, PendingGroup] = {}
        self.lock = threading.Lock()
        self.timed_out = self.partial = 0

    def add(self, group: PendingGroup) -> None:
        with self.lock:
            self.groups[group.gid] = group

    def record_score(self, gid: int, index: int, score: float, correct: float) -> None:
        """One completion scored; the group is handed over when all n are."""
        self.record_scores(gid, [index], [score], [correct])

    def record_scores(self, gid: int, indices: Sequence[int], scores: Sequence[float],
                      correct: Sequence[float]) -> None:
        """Completions ``indices`` scored; the group is handed over when all n are."""
        with self.lock:
            group = self.groups.get(gid)
            if group is None or group.settled:
                return  # timed out already: the late score is ignored
            for i, score, ok in zip(indices, scores, correct):
                group.scores[i] = (score, ok)
            if len(group.scores) < len(group.output.completions):
                return
            self._settle(group, keep=sorted(group.scores))

    def expire(self, now: float) -> None:
        """Settle every group past its deadline by the straggler policy."""
        with self.lock:
            for group in [g for g in self.groups.values() if now > g.deadline and not g.settled]:
                self.timed_out += 1
                keep = sorted(group.scores) if self.policy == "partial" and group.output is not None else []
                self.partial += bool(keep)
                self._settle(group, keep)

    def _settle(self, group: PendingGroup, keep: list[int]) -> None:
        group.settled = True
        del self.groups[group.gid]
        if not keep:
            self.staleness.release()
            self.buffer.release(group.gid)
            return
        out = group.output
        comps = [out.completions[i] for i in keep]
        self.buffer.put(ScoredGroup(group.example, RequestOutput(out.prompt_token_ids, out.prompt, comps),
                                    [group.scores[i][0] for i in keep], [group.scores[i][1] for i in keep],
                                    group.gid, group.version, round_index=group.round_index))
        self.staleness.accept()


class RolloutLoop:
    """One iteration: admit up to ``chunk`` groups, generate them in one call, submit them for
    scoring (``submit_score`` runs ``score`` elsewhere and calls back).

    Scoring tasks: one per completion when ``per_completion`` (a ``partial`` straggler policy
    keeps the completions of a late group already scored, and one hung verifier then holds one
    completion), else one per group, as the sync controller scores (n times fewer tasks on the
    trainer's process; a reward pool still spreads the group's completions over its workers)."""

    def __init__(self, backend, staleness: StalenessManager, inflight: InFlight, prompts: Iterator[Example],
                 encode: Callable[[Example], list[int]], params: SamplingParams, chunk: int, seed: int,
                 score: ScoreFn, submit_score: Callable[[Callable[[], None]], None], gate,
                 group_timeout_s: Optional[float], per_completion: bool = True):
        self.backend, self.staleness, self.inflight = backend, staleness, inflight
        self.prompts, self.encode, self.params, self.chunk, self.seed = prompts, encode, params, chunk, seed
        self.score, self.submit_score, self.gate, self.timeout = score, submit_score, gate, group_timeout_s
        self.per_completion = per_completion
        self._rounds = itertools.count(1)
        self._lock = threading.Lock()  # prompt stream + round counter are shared by the workers
        self.busy_seconds = self.wait_seconds = 0.0
        self.generated_tokens = 0

    def run_once(self, poll: float = 0.2) -> None:
        t0 = time.perf_counter()
        with self._lock:
            ids = self.staleness.admit(self.chunk, timeout=poll)
            examples = [next(self.prompts) for _ in ids]
            round_index = next(self._rounds) if ids else 0
        t1 = time.perf_counter()
        self.wait_seconds += t1 - t0
        if not ids:
            return
        deadline = t1 + self.timeout if self.timeout else float("inf")
        groups = [PendingGroup(gid, ex, self.backend.version, deadline, round_index=round_index)
                  for gid, ex in zip(ids, examples)]
        for g in groups:
            self.inflight.add(g)
        outputs = self._generate(examples, round_index)
        self.busy_seconds += time.perf_counter() - t1
        for g, out in zip(groups, outputs):
            g.output = out
            self.generated_tokens += sum(len(c.token_ids) for c in out.completions)
            parts = [[i] for i in range(len(out.completions))] if self.per_completion else [range(len(out.completions))]
            for indices in parts:
                self.submit_score(self._scorer(g, list(indices)))

    def resume_rounds(self, next_round: int) -> None:
        """Number the next rollout round ``next_round`` (a resumed run: the seeds continue)."""
        with self._lock:
            self._rounds = itertools.count(next_round)

    def _generate(self, examples: list[Example], round_index: int) -> list[RequestOutput]:
        """Round r samples with seed·1_000_003 + r: with max_staleness=0, round r is step r of the
        sync controller, so both see the same prompts and the same seeds."""
        params = dataclasses.replace(self.params, seed=self.seed * 1_000_003 + round_index)
        with self.gate.reading():
            return generate_for_examples(self.backend, self.encode, examples, params)

    def _scorer(self, group: PendingGroup, indices: list[int]) -> Callable[[], None]:
        def run():
            completions = [group.output.completions[i] for i in indices]
            scores, correct = self.score(group.example, RequestOutput(group.output.prompt_token_ids, None, completions))
            self.inflight.record_scores(group.gid, indices, scores, correct)
        return run
