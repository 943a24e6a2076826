"""The adaptive speculation gate (spec/adaptive.py), driven by a fake clock.

A simulated engine asks the gate which step to run, advances the clock by that step's cost and
records the tokens it emitted; costs are the H200's T = 1 draft-model ones (a speculative step
~4.6 plain steps of wall for ~1.85 tokens per row) or a greedy tail's (~1.6 plain steps for ~4.9
tokens per row). Then the engine itself with the gate: exact tokens and log-probs with speculative
and plain steps mixed, and the metrics.
"""
import pytest
from conftest import assert_same_completions, build_tiny, make_llm

from asyncrl.engine.spec.adaptive import PLAIN, SPEC, AdaptiveGate, bucket
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.decoding import SpeculativeDecoder
from asyncrl.types import SamplingParams

ROWS = 8
SAMPLED = {SPEC: (4.6, 1.85), PLAIN: (1.0, 1.0)}   # mode -> (wall per step, tokens per row)
GREEDY = {SPEC: (1.6, 4.9), PLAIN: (1.0, 1.0)}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(gate: AdaptiveGate, clock: FakeClock, costs: dict, steps: int, rows: int = ROWS) -> list[bool]:
    """``steps`` engine steps; each is timed whole on the fake clock. Returns the modes chosen."""
    modes = []
    for _ in range(steps):
        mode = gate.choose(rows)
        start = clock()
        seconds, per_row = costs[mode]
        clock.t += seconds
        gate.record(mode, rows, round(per_row * rows), clock() - start)
        modes.append(mode)
    return modes


def new_gate(**kw):
    clock = FakeClock()
    return AdaptiveGate(clock=clock, **kw), clock


def spec_runs(modes: list[bool]) -> list[tuple[int, int]]:
    """(start, length) of each run of speculative steps."""
    runs, start = [], None
    for i, m in enumerate(modes + [PLAIN]):
        if m is SPEC and start is None:
            start = i
        elif m is PLAIN and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 16, 32]


def test_slower_speculation_is_switched_off_after_the_first_window():
    gate, clock = new_gate(dwell=4, probe_min=32)
    modes = run(gate, clock, SAMPLED, 2048)
    # the old behaviour first (4 speculative steps), then a plain window, then plain: its estimate won
    assert modes[:4] == [SPEC] * 4 and modes[4:8] == [PLAIN] * 4
    assert all(m is PLAIN for m in modes[8:8 + 32])
    assert gate.metrics["spec_gate_speculating"] is False
    # time: within 5% of plain decode alone (the probes' cost), where always speculating is 0.40x
    tokens = sum(round(SAMPLED[m][1] * ROWS) for m in modes)
    plain_rate = ROWS / SAMPLED[PLAIN][0]
    always = round(ROWS * SAMPLED[SPEC][1]) / SAMPLED[SPEC][0]
    assert tokens / clock.t > 0.95 * plain_rate and always < 0.45 * plain_rate
    m = gate.metrics
    assert m["spec_gate_plain_steps"] == modes.count(PLAIN)
    assert m["spec_gate_plain_tokens_per_s"] == pytest.approx(plain_rate, rel=1e-3)
    assert m["spec_gate_spec_tokens_per_s"] == pytest.approx(always, abs=0.05)


def test_speculation_is_probed_again_every_interval_doubling_to_the_cap():
    gate, clock = new_gate(dwell=4, probe_min=32, probe_max=128, probe_budget=0)  # the doubling alone
    modes = run(gate, clock, SAMPLED, 1200)
    runs = spec_runs(modes)
    assert runs[0] == (0, 4) and all(n == 4 for _, n in runs)  # every probe: dwell speculative steps
    gaps = [b - (a + 4) for (a, _), (b, _) in zip(runs, runs[1:])]  # plain steps between probes
    # the first window's plain probe (4) + 32 plain steps; then each probe confirms plain: 64, 128, 128, ...
    assert gaps[:4] == [4 + 32, 64, 128, 128] and set(gaps[3:]) == {128}
    assert gate.metrics["spec_gate_probes"] == len(runs) - 1 + 1  # speculative probes + the first plain window


def test_a_costly_probe_waits_until_it_costs_the_budget():
    """A probe that lost L seconds against home is next made after L / (budget x home step) home
    steps: here 4 speculative steps of 4.6 s for 60 tokens, where plain takes 7.5 s, lose 10.9 s
    (+ 20 s of a switch step once one is recorded, less its tokens' 1.9 s); at 2% of 1 s steps that is
    545, then 1,451 steps (more than the doubling's 1,090)."""
    gate, clock = new_gate(dwell=4, probe_min=32, probe_max=4096, probe_budget=0.02)
    modes = run(gate, clock, SAMPLED, 300)  # the first window, the first probe (priced: 545 to the next)
    assert [b - (a + 4) for (a, _), (b, _) in zip(spec_runs(modes), spec_runs(modes)[1:])] == [4 + 32]
    gate.record_switch(ROWS, 15, 20.0)  # a catch-up step: 20 s, a speculative step's 15 tokens
    more = run(gate, clock, SAMPLED, 2400)
    runs = spec_runs(modes + more)
    gaps = [b - (a + 4) for (a, _), (b, _) in zip(runs, runs[1:])]
    assert gaps[:3] == [4 + 32, 545, round((10.9 + 20.0 - 15 / 8) / 0.02)]
    # over 3,000 steps the probes cost under 3% of plain decode's rate (doubling alone: ~5%)
    tokens = sum(round(SAMPLED[m][1] * ROWS) for m in modes + more)
    assert tokens / clock.t > 0.97 * ROWS / SAMPLED[PLAIN][0]


def test_a_cheap_probe_keeps_the_doubling():
    """Where the other mode is nearly as fast, a probe costs little: the interval just doubles."""
    gate, clock = new_gate(dwell=4, probe_min=32, probe_max=4096, probe_budget=0.02)
    close = {SPEC: (1.0, 0.875), PLAIN: (1.0, 1.0)}  # speculation 12.5% slower: a probe loses 0.5 s
    modes = run(gate, clock, close, 600)
    gaps = [b - (a + 4) for (a, _), (b, _) in zip(spec_runs(modes), spec_runs(modes)[1:])]
    assert gaps[:3] == [4 + 32, 64, 128]


def test_faster_speculation_stays_on():
    gate, clock = new_gate(dwell=4, probe_min=32)
    modes = run(gate, clock, GREEDY, 2048)
    assert modes.count(SPEC) > 0.97 * len(modes)
    assert gate.metrics["spec_gate_speculating"] is True and gate.metrics["spec_gate_switches"] == 0
    # plain is re-probed now and then too (its estimate stays fresh)
    assert gate.metrics["spec_gate_probes"] >= 3


def test_a_phase_change_switches_back_both_ways():
    gate, clock = new_gate(dwell=4, probe_min=16, probe_max=64)
    first = run(gate, clock, SAMPLED, 300)          # sampled: drafts do not pay
    assert first[-50:].count(SPEC) <= 4
    second = run(gate, clock, GREEDY, 300)          # a greedy / repetitive stretch: they pay again
    on = second.index(SPEC)
    assert on <= 64 and second[on + 20:].count(PLAIN) < 0.1 * len(second[on + 20:])
    third = run(gate, clock, SAMPLED, 300)          # and stop paying: off within one window
    # the window of 8 holds 3 fast steps and 5 slow ones at the switch; then a full probe interval of plain
    assert third[:5] == [SPEC] * 5 and third[5:5 + 16] == [PLAIN] * 16 and third[5 + 16] is SPEC
    assert gate.metrics["spec_gate_switches"] >= 3


def test_equal_modes_do_not_flap():
    gate, clock = new_gate(dwell=4, margin=0.05, probe_min=16)
    same = {SPEC: (2.0, 2.0), PLAIN: (1.0, 1.0)}   # equal tokens per second
    modes = run(gate, clock, same, 500)
    assert gate.metrics["spec_gate_switches"] == 0 and modes.count(SPEC) > 0.9 * len(modes)


def test_batch_buckets_keep_their_own_estimates():
    gate, clock = new_gate(dwell=4, probe_min=32)
    run(gate, clock, SAMPLED, 100, rows=8)
    assert gate.choose(8) is PLAIN
    assert gate.choose(2) is SPEC  # a new bucket starts speculating (its own first window)
    assert set(gate.buckets) == {8, 2}


def test_unmeasured_steps_do_not_stall_the_gate():
    """Steps the engine could not time whole are not recorded: the gate still moves on."""
    gate, _ = new_gate(dwell=4)
    modes = [gate.choose(ROWS) for _ in range(40)]
    assert PLAIN in modes and SPEC in modes


class _Sched:
    """What ``should_run`` reads of the scheduler: its running and waiting queues."""

    def __init__(self, running: int, waiting: int):
        self.running, self.waiting = list(range(running)), list(range(waiting))


def test_the_hard_limits_come_before_the_gate():
    gate, clock = new_gate(dwell=4, probe_min=32)
    run(gate, clock, GREEDY, 50)
    chosen = gate.metrics["spec_gate_plain_steps"]
    dec = SpeculativeDecoder.__new__(SpeculativeDecoder)  # should_run reads config and gate only
    dec.config, dec.gate = SpeculativeConfig(disable_by_batch_size=16), gate
    assert dec.should_run(_Sched(8, 0)) is True
    assert dec.should_run(_Sched(8, 1)) is False and dec.should_run(_Sched(17, 0)) is False
    assert dec.should_run(_Sched(0, 0)) is False
    assert gate.metrics["spec_gate_plain_steps"] == chosen  # the limits' plain steps are not the gate's
    dec.gate = None  # adaptive=False: the limits alone
    assert dec.should_run(_Sched(8, 0)) is True


# ---- in the engine (CPU, fp32): the gate only picks which exact step runs -------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("adaptive_target"))


REPETITIVE = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [20, 21, 22, 23, 24, 20, 21]]


def slow_speculation(llm, spec_cost: float):
    """A fake clock on ``llm``'s gate: a verify pass costs ``spec_cost``, a plain decode launch 1."""
    clock = FakeClock()
    llm.spec.gate = AdaptiveGate(clock=clock, dwell=2, probe_min=4, probe_max=8)
    verify, launch = llm.spec.verify_step.run, llm.runner.launch

    def timed_verify(*a, **kw):
        clock.t += spec_cost
        return verify(*a, **kw)

    def timed_launch(*a, **kw):
        clock.t += 1.0
        return launch(*a, **kw)

    llm.spec.verify_step.run, llm.runner.launch = timed_verify, timed_launch


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """An untrained EAGLE head (exactness holds for any drafter)."""
    from asyncrl.engine.models.config import ModelConfig
    from asyncrl.engine.spec.eagle_head import new_head

    path = str(tmp_path_factory.mktemp("adaptive_head"))
    new_head(ModelConfig.from_dir(target), seed=1).save(path)
    return path


@pytest.mark.parametrize("method,overlapped", [("ngram", False), ("draft_model", False), ("eagle", False),
                                               ("ngram", True)])
def test_engine_mixes_speculative_and_plain_steps_exactly(target, head, method, overlapped):
    """Speculation measured slower (fake clock): the engine switches to plain steps and probes
    speculation again; greedy and sampled (one-hot drafts) tokens and log-probs equal speculation off's.
    ``overlapped``: plain steps with async scheduling (GPU's default), timed only when one spans a
    whole decode step (a decode step in flight)."""
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"model": {"draft_model": target, "eagle": head}[method]} if method != "ngram" else {})}
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True),
                   SamplingParams(temperature=1.0, top_k=20, max_tokens=40, seed=3, ignore_eos=True, n=2,
                                  logprobs=True)):
        off = make_llm(target).generate(REPETITIVE, params)
        llm = make_llm(target, speculative_config=spec, async_scheduling=overlapped)
        slow_speculation(llm, spec_cost=40.0)
        on = llm.generate(REPETITIVE, params)
        assert [c.token_ids for o in on for c in o.outputs] == [c.token_ids for o in off for c in o.outputs]
        assert_same_completions(off, on, atol=1e-4)
        m = llm.metrics
        assert m["spec_steps"] > 0 and m["spec_gate_plain_steps"] > 0 and m["spec_gate_probes"] >= 2
        # eagle: after plain steps its head catches up on the positions it missed (features recorded)
        if method == "draft_model" and params.temperature == 0:
            # the target as its own draft: every draft accepted, so after each run of plain steps the
            # draft model caught up on the tokens it had not seen (its K/V in step with the target's)
            assert m["spec_acceptance_rate"] == 1.0
        # per batch bucket (3 or 6 running, then fewer as sequences finish apart): plain measured faster
        both = [st.rates for st in llm.spec.gate.buckets.values() if st.rates[SPEC].value and st.rates[PLAIN].value]
        assert both and all(r[PLAIN].value > r[SPEC].value for r in both)
        # every plain choice ran a plain decode step (overlapped: but the last, which only read the step in flight)
        assert m["decode_steps"] + overlapped >= m["spec_gate_plain_steps"]


def costly_catch_up(llm, cost: float) -> None:
    """On top of ``slow_speculation``'s clock: a proposer's catch-up (the draft model's K/V prefill of
    positions it has not seen, the EAGLE head's entries for them) costs ``cost``."""
    clock, proposer = llm.spec.gate.clock, llm.spec.proposer
    name = "_catch_up"
    inner = getattr(proposer, name)

    def timed(*a, **kw):
        out = inner(*a, **kw)
        clock.t += cost if proposer.catch_up_tokens else 0.0
        return out

    setattr(proposer, name, timed)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_catch_up_is_not_timed_as_speculation(target, head, method):
    """Speculation measured faster (a verify pass 0.3 of a plain step) but each catch-up very slow
    (100 plain steps: the H200's draft model at 2.3x off ran 0.78x under the gate, its first
    speculative step of every probe paying for the prefill of the positions decoded plain): the
    gate times the steps after the catch-up and keeps speculating; tokens equal speculation off's."""
    spec = {"method": method, "num_speculative_tokens": 3, "model": {"draft_model": target, "eagle": head}[method]}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True)
    off = make_llm(target).generate(REPETITIVE, params)
    llm = make_llm(target, speculative_config=spec)
    slow_speculation(llm, spec_cost=0.3)
    costly_catch_up(llm, cost=100.0)
    on = llm.generate(REPETITIVE, params)
    assert [c.token_ids for o in on for c in o.outputs] == [c.token_ids for o in off for c in o.outputs]
    m = llm.metrics
    assert m["spec_catch_up_steps"] >= 1  # the new sequences' first speculative step (and after plain probes)
    # where the time went: every catch-up's cost in catch_up_seconds, none in the timed speculative steps'
    assert m["spec_catch_up_seconds"] >= 100.0 * m["spec_catch_up_steps"] and m["spec_catch_up_tokens"] > 0
    assert 0 < m["spec_seconds"] < 100.0
    # ... and handed to the gate as the price of switching into speculation (what its probes pay)
    assert any(st.switch[1] >= 100.0 and st.switch[0] > 0 for st in llm.spec.gate.buckets.values())
    assert m["spec_plain_timed_steps"] <= m["decode_steps"] and m["spec_plain_seconds"] >= 0
    both = [st for st in llm.spec.gate.buckets.values() if st.rates[SPEC].value and st.rates[PLAIN].value]
    assert both and all(st.home is SPEC and st.rates[SPEC].value > st.rates[PLAIN].value for st in both)
    # plain only in the probes (dwell 2, a few per bucket), never home
    assert m["spec_gate_switches"] == 0 and m["spec_gate_plain_steps"] < m["spec_steps"]


def test_engine_gate_on_by_default_and_off_by_key(target):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = make_llm(target).generate(REPETITIVE, params)
    on = make_llm(target, speculative_config={"method": "ngram"})
    assert on.spec.gate is not None
    assert [c.token_ids for o in on.generate(REPETITIVE, params) for c in o.outputs] == \
        [c.token_ids for o in off for c in o.outputs]
    m = on.metrics
    assert {"spec_gate_plain_steps", "spec_gate_spec_tokens_per_s", "spec_gate_plain_tokens_per_s",
            "spec_gate_probes", "spec_gate_switches", "spec_gate_bucket"} <= set(m)
    assert m["spec_steps"] > 0 and m["spec_gate_bucket"] in (1, 2, 4)  # 3 running, then fewer
    always = make_llm(target, speculative_config={"method": "ngram", "adaptive": False})
    assert always.spec.gate is None
    always.generate(REPETITIVE, params)
    assert "spec_gate_plain_steps" not in always.metrics
    assert always.metrics["decode_steps"] == 0  # every decode step speculated


def test_rollout_config_passes_adaptive():
    from asyncrl.config import SpeculativeRolloutConfig

    assert SpeculativeRolloutConfig(method="ngram").engine_dict()["adaptive"] is True
    assert SpeculativeRolloutConfig(method="ngram", adaptive=False).engine_dict()["adaptive"] is False
    assert SpeculativeConfig.from_any(SpeculativeRolloutConfig(method="ngram").engine_dict()).adaptive
