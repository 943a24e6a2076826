"""RewardPool: weights, per-component results, failures, timeouts, streaming."""
import time

import pytest

import reward_fixtures
from asyncrl.rewards.pool import RewardPool, RewardRequest, RewardSpec


def _requests(*responses, answer="x"):
    return [RewardRequest("p", r, {"answer": answer}) for r in responses]


def test_weighted_total_and_components_inline():
    specs = [RewardSpec("len", "reward_fixtures:length", weight=2.0),
             RewardSpec("match", reward_fixtures.echo_field, weight=0.5)]
    with RewardPool(specs, mode="inline") as pool:
        [a, b] = pool.score(_requests("x", "abcde"))
    # a: len 0.1 * 2 + match 1.0 * 0.5 = 0.7;  b: 0.5 * 2 + 0 * 0.5 = 1.0
    assert a.total == pytest.approx(0.7) and a.components == {"len": 0.1, "match": 1.0}
    assert b.total == pytest.approx(1.0) and b.components == {"len": 0.5, "match": 0.0}
    assert a.failed == {} and b.failed == {}


def test_an_overflowing_weighted_total_is_a_failure():
    # each component is finite (1e308) but 2 x 1e308 = inf: the total falls back to the
    # default score and the item counts as failed (its loss would be non-finite otherwise)
    spec = RewardSpec("big", "reward_fixtures:constant", weight=2.0, kwargs={"value": 1e308})
    with RewardPool([spec], mode="inline", default_score=0.0) as pool:
        [result] = pool.score(_requests("y"))
    assert result.total == 0.0 and result.components == {"big": 1e308}
    assert "inf" in result.failed["total"] and pool.failures[-1].reward == "total"


def test_bound_kwargs_reach_the_function():
    spec = RewardSpec("c", "reward_fixtures:constant", kwargs={"value": 0.25})
    with RewardPool([spec], mode="inline") as pool:
        assert pool.score(_requests("y"))[0].total == 0.25


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_raise_none_nan_text_exit_give_default_and_are_recorded(mode):
    specs = [RewardSpec(name, f"reward_fixtures:{name}") for name in
             ("raises", "returns_none", "returns_nan", "returns_text", "exits")]
    specs.append(RewardSpec("ok", "reward_fixtures:constant"))
    with RewardPool(specs, default_score=-1.0, mode=mode, num_workers=2) as pool:
        [result] = pool.score(_requests("resp"))
        stats = pool.stats()
    # five components at the default -1, "ok" at 1: total = -5 + 1
    assert result.total == -4.0
    assert result.components["ok"] == 1.0 and result.components["raises"] == -1.0
    assert set(result.failed) == {"raises", "returns_nan", "returns_text", "exits"}  # None is not a failure
    assert "RuntimeError: bad reward for 'resp'" in result.failed["raises"]
    assert stats["calls"] == 6 and stats["failures"] == 4 and stats["nones"] == 1
    failure = next(f for f in pool.failures if f.reward == "raises")
    assert failure.response == "resp" and failure.fields == {"answer": "'x'"}


def test_thread_mode_timeout_does_not_wedge_the_pool():
    with RewardPool([RewardSpec("h", "reward_fixtures:hangs")], mode="thread",
                    num_workers=1, timeout_s=0.3, default_score=0.0) as pool:
        start = time.monotonic()
        results = pool.score(_requests("hang", "fine", "hang", "fine"))
        elapsed = time.monotonic() - start
        stats = pool.stats()
    assert [r.total for r in results] == [0.0, 1.0, 0.0, 1.0]
    assert "timed out" in results[0].failed["h"]
    assert stats["timeouts"] == 2 and stats["threads_abandoned"] == 2
    assert elapsed < 3.0


def test_process_mode_kills_hung_and_crashed_workers_and_goes_on():
    specs = [RewardSpec("h", "reward_fixtures:hangs"), RewardSpec("len", "reward_fixtures:length")]
    with RewardPool(specs, mode="process", num_workers=2, timeout_s=1.0) as pool:
        results = pool.score(_requests("hang", "fine", "hang", "abc"))
        stats = pool.stats()
        # a worker that dies mid-call is replaced too
        with RewardPool([RewardSpec("k", "reward_fixtures:kills_worker")], mode="process",
                        num_workers=1, timeout_s=5.0) as crashing:
            [crashed] = crashing.score(_requests("z"))
            assert "worker died" in crashed.failed["k"]
            assert crashing.stats()["worker_restarts"] == 1
        after = pool.score(_requests("again"))
    assert [r.components["h"] for r in results] == [0.0, 1.0, 0.0, 1.0]
    assert [r.components["len"] for r in results] == [0.4, 0.4, 0.4, 0.3]
    assert stats["timeouts"] == 2 and stats["worker_restarts"] == 2
    assert after[0].components == {"h": 1.0, "len": 0.5}


def test_submit_streams_futures():
    with RewardPool([RewardSpec("len", "reward_fixtures:length")], mode="thread") as pool:
        futures = pool.submit(_requests("a", "bb"))
        assert [f.result(timeout=5).total for f in futures] == [0.1, 0.2]


def test_bad_configuration_fails_at_construction():
    with pytest.raises(KeyError, match="unknown reward"):
        RewardPool([RewardSpec("a", "no_such_reward")], mode="inline")
    with pytest.raises(ValueError, match="unique"):
        RewardPool([RewardSpec("a", "format"), RewardSpec("a", "format")], mode="inline")
    with pytest.raises(ValueError, match="mode"):
        RewardPool([RewardSpec("a", "format")], mode="fibers")
    pool = RewardPool([RewardSpec("a", "format")], mode="inline")
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(_requests("x"))


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_batched_reward_is_called_once_per_submit(mode):
    specs = [RewardSpec("b", "reward_fixtures:batched_lengths"), RewardSpec("one", "reward_fixtures:length")]
    with RewardPool(specs, mode=mode) as pool:
        results = pool.score(_requests("a", "bbb"))
        wrong = RewardPool([RewardSpec("w", "reward_fixtures:batched_wrong_size")], mode=mode)
        broken = wrong.score(_requests("a", "b"))
        wrong.close()
    assert [r.components["b"] for r in results] == [0.1, 0.3]
    assert [r.total for r in results] == [0.2, 0.6]
    assert all("returned 1 for 2 items" in r.failed["w"] for r in broken)
    assert pool.stats()["components"]["b"]["calls"] == 2


def test_close_resolves_queued_items():
    pool = RewardPool([RewardSpec("h", "reward_fixtures:hangs")], mode="thread", num_workers=1, timeout_s=0.5)
    futures = pool.submit(_requests("hang", "fine", "fine"))
    time.sleep(0.1)  # the first call is running, the other two are queued
    pool.close()
    results = [f.result(timeout=5) for f in futures]
    assert results[0].failed["h"].startswith("timed out")
    assert all(r.failed["h"] == "pool closed before this call ran" for r in results[1:])


def test_per_spec_timeout_overrides_the_pool_timeout():
    specs = [RewardSpec("slow_ok", "reward_fixtures:hangs", timeout_s=0.2), RewardSpec("len", "reward_fixtures:length")]
    with RewardPool(specs, mode="thread", num_workers=2, timeout_s=30) as pool:
        start = time.monotonic()
        [result] = pool.score(_requests("hang"))
    assert time.monotonic() - start < 5 and "timed out after 0.2 s" in result.failed["slow_ok"]


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_async_reward_functions(mode):
    with RewardPool([RewardSpec("a", "reward_fixtures:async_length")], mode=mode) as pool:
        assert [r.total for r in pool.score(_requests("ab", "abcd"))] == [0.2, 0.4]
