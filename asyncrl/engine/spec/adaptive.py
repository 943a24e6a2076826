"""AdaptiveGate: speculate only while it measurably pays (issue 23).

Speculation is exact either way; what it changes is speed, and that depends on what is generated:
on an H200 (0.6B target, batch 8) greedy tails ran 1.9-2.5x faster with drafts, while at
temperature 1 (RL rollouts) every drafter was SLOWER than plain decode (0.41-0.67x: acceptance
0.06-0.43 does not pay for the drafting and the (k + 1)-token verify pass). No constant threshold
separates the two, so the gate measures both modes as the engine runs and picks the faster.

Measure: wall seconds of whole engine steps (``record``): tokens emitted per second, per mode,
keyed by a batch-size bucket (the next power of two of the running batch: 5..8 -> 8). An estimate
is the ratio of sums over the mode's last ``window`` steps (tokens / seconds).

Decide (``choose``), per bucket:

* A new bucket starts speculating (the old behaviour) for ``dwell`` measured steps, then probes
  plain for ``dwell`` measured steps; from then on the faster mode is "home".
* In home, the running mode's estimate is compared with the other mode's (kept from its last
  run) every step; the other mode takes over when it is faster by more than ``margin`` (hysteresis:
  no flapping between two equal modes).
* Every ``interval`` steps in home the other mode is probed for ``dwell`` measured steps (its
  estimate restarts from them, so a phase change shows at once: a greedy / repetitive stretch
  where drafts pay again, or one where they stop paying). A probe that confirms home at least
  doubles the interval (up to ``probe_max``); one that changes home resets it to ``probe_min``.
* A probe's price is what it lost against home: its steps' seconds beyond what home would have
  taken for the same tokens, plus the switch step (``record_switch``: the speculative step whose
  proposer first caught up on the positions decoded plain, not timed as speculation; for a plain
  probe, the bucket's last one, paid on the way back home). The next interval is at least that
  price over ``probe_budget`` times home's seconds per step, so probing costs at most that share
  of the time (2%). On the H200 at T = 1 (draft model; 2026-12-04) a probe lost ~25 ms, ~10 of them
  the catch-up, against 1.4 ms plain steps: doubling from 32 probed 6 times in a 2,048-token tail
  (~4% of it); the budget spaces them ~900 steps apart.

After entering a mode (a probe, or a switch of home) the gate stays in it for ``dwell`` measured
steps (at most ``4 * dwell`` choices, in case steps go unmeasured) before it decides again: the
mode's estimate restarts there, so decisions rest on fresh steps. Going back home after a probe
keeps home's estimate.
The clock is injectable (tests drive the gate with a fake one).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

SPEC, PLAIN = True, False


def bucket(n: int) -> int:
    """The batch-size bucket of ``n`` running sequences: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, (n - 1).bit_length())


class Rate:
    """Tokens per second over the last ``window`` recorded steps (a ratio of sums)."""

    def __init__(self, window: int):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    def clear(self) -> None:
        self.steps.clear()

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def value(self) -> Optional[float]:
        seconds = sum(s for _, s in self.steps)
        return sum(t for t, _ in self.steps) / seconds if self.steps and seconds > 0 else None


@dataclass
class Bucket:
    """One batch-size bucket's estimates and state. ``mode``: what runs now; ``home``: the mode
    believed faster (``mode != home`` while probing)."""

    rates: dict
    mode: bool = SPEC
    home: bool = SPEC
    fresh: int = 0          # measured steps of ``mode`` since it was entered
    tries: int = 0          # choices of ``mode`` since it was entered
    since_probe: int = 0    # steps in home since the last probe
    interval: int = 0
    probed: set = field(default_factory=set)  # modes measured at least once
    switch: tuple = (0, 0.0)  # (tokens, seconds) of the last step that switched into speculation
    stale: set = field(default_factory=set)   # modes whose estimate restarts at their next record


class AdaptiveGate:
    def __init__(self, window: int = 8, dwell: int = 4, margin: float = 0.05, probe_min: int = 32,
                 probe_max: int = 1024, probe_budget: float = 0.02, clock: Callable[[], float] = time.perf_counter):
        if not 1 <= dwell <= window:
            raise ValueError(f"need 1 <= dwell <= window, got dwell={dwell}, window={window}")
        self.window, self.dwell, self.margin = window, dwell, margin
        self.probe_min, self.probe_max, self.probe_budget = probe_min, probe_max, probe_budget
        self.clock = clock
        self.buckets: dict[int, Bucket] = {}
        self.last: Optional[int] = None  # the bucket of the last choice (metrics)
        self.plain_chosen = 0            # choices of plain decode where speculation was allowed
        self.probes = 0
        self.switches = 0

    def _bucket(self, n: int) -> Bucket:
        b = bucket(n)
        if b not in self.buckets:
            self.buckets[b] = Bucket({SPEC: Rate(self.window), PLAIN: Rate(self.window)}, interval=self.probe_min)
        return self.buckets[b]

    def choose(self, n: int) -> bool:
        """Whether the next step of ``n`` running sequences speculates (True) or decodes plain."""
        self.last = bucket(n)
        st = self._bucket(n)
        st.tries += 1
        if st.fresh < self.dwell and st.tries <= 4 * self.dwell:
            return self._chose(st, st.mode)
        other = not st.mode
        if other not in st.probed:  # the first window of the other mode (a new bucket's plain probe)
            return self._enter(st, other, probe=True)
        winner = self._winner(st)
        if st.mode != st.home:  # a probe ended: home is whichever won
            changed = winner != st.home
            st.interval = self.probe_min if changed else min(max(2 * st.interval, self._priced(st)), self.probe_max)
            st.home, st.mode, st.since_probe = winner, winner, 0
            self.switches += changed
            # the probed mode won: it runs on, its estimate fresh; lost: home's estimate from before stands
            st.fresh = max(st.fresh, self.dwell)
            return self._chose(st, winner)
        if winner != st.home:  # the running mode fell behind the other's last estimate
            st.home, st.interval, st.since_probe = winner, self.probe_min, 0
            self.switches += 1
            return self._enter(st, winner)
        if st.since_probe >= st.interval:
            return self._enter(st, other, probe=True)
        return self._chose(st, st.mode)

    def _winner(self, st: Bucket) -> bool:
        """The faster mode; the incumbent (home) keeps it unless beaten by more than ``margin``."""
        rates = {m: st.rates[m].value or 0.0 for m in (SPEC, PLAIN)}
        challenger = not st.home
        return challenger if rates[challenger] > rates[st.home] * (1 + self.margin) else st.home

    def _priced(self, st: Bucket) -> int:
        """Home steps to the next probe for the probe just ended (mode != home) to cost at most
        ``probe_budget`` of the time: its loss against home's rate over the budget's share of a home step."""
        home, probe = st.rates[st.home], st.rates[st.mode].steps
        if not home.value or self.probe_budget <= 0:
            return 0
        switch_tokens, switch_seconds = st.switch
        tokens = sum(t for t, _ in probe) + switch_tokens
        lost = sum(s for _, s in probe) + switch_seconds - tokens / home.value
        home_step = sum(s for _, s in home.steps) / len(home)
        return round(lost / (self.probe_budget * home_step)) if lost > 0 else 0

    def _enter(self, st: Bucket, mode: bool, probe: bool = False) -> bool:
        """Run ``mode`` from now; its estimate restarts with its next recorded step (a probe
        measures the present, not the past)."""
        st.mode, st.fresh, st.tries = mode, 0, 1
        st.stale.add(mode)
        if probe:
            self.probes += 1
            st.since_probe = 0
        return self._chose(st, mode)

    def _chose(self, st: Bucket, mode: bool) -> bool:
        self.plain_chosen += mode is PLAIN
        st.since_probe += mode == st.home  # the interval counts home's steps between probes
        return mode

    def record(self, speculative: bool, rows: int, tokens: int, seconds: float) -> None:
        """A whole step of ``rows`` sequences that emitted ``tokens`` in ``seconds`` of wall time."""
        if rows <= 0 or seconds <= 0:
            return
        st = self._bucket(rows)
        if speculative in st.stale:
            st.stale.discard(speculative)
            st.rates[speculative].clear()
        st.rates[speculative].add(tokens, seconds)
        st.probed.add(speculative)
        if speculative == st.mode:
            st.fresh += 1

    def record_switch(self, rows: int, tokens: int, seconds: float) -> None:
        """A speculative step of ``rows`` sequences whose proposer first caught up on positions
        decoded plain: not a measure of speculating (``record`` does not see it), but the price of
        switching into it, which a probe pays (see ``_priced``)."""
        if rows > 0 and seconds > 0:
            self._bucket(rows).switch = (tokens, seconds)

    def reset(self) -> None:
        """Forget every estimate (the counters of ``metrics`` stay): the next steps start as a new engine's."""
        self.buckets.clear()
        self.last = None

    @property
    def estimates(self) -> dict:
        """Batch bucket -> (speculative, plain) tokens/s, None where not measured; and whether it speculates."""
        return {b: dict(spec=st.rates[SPEC].value, plain=st.rates[PLAIN].value, speculating=st.home)
                for b, st in sorted(self.buckets.items())}

    @property
    def metrics(self) -> dict:
        st = self.buckets.get(self.last) if self.last is not None else None
        rate = lambda m: round(st.rates[m].value or 0.0, 1) if st is not None else 0.0  # noqa: E731
        return dict(spec_gate_plain_steps=self.plain_chosen, spec_gate_probes=self.probes,
                    spec_gate_switches=self.switches, spec_gate_bucket=self.last or 0,
                    spec_gate_spec_tokens_per_s=rate(SPEC), spec_gate_plain_tokens_per_s=rate(PLAIN),
                    spec_gate_speculating=bool(st.home) if st is not None else True)
