"""The router places whole groups by outstanding tokens, keeps keys on their replica, and
places the keys of a removed replica afresh on the others."""
import threading

import pytest

from asyncrl.rollout.router import NoReplicaLeft, Router


def test_least_outstanding_tokens_not_round_robin():
    r = Router(3)
    # costs 900, 100, 100: replica 0 takes the big group, 1 and 2 the small ones; the next
    # group goes to the least loaded of them (1, ties to the lowest index), not back to 0
    assert [r.place(k, c) for k, c in (("a", 900), ("b", 100), ("c", 100), ("d", 50))] == [0, 1, 2, 1]
    assert r.outstanding == [900, 150, 100]
    r.finish(0, 900)
    assert r.place("e", 10) == 0  # 0 is idle now


def test_keys_stick_to_their_replica_until_released():
    r = Router(2)
    assert r.place("session", 500) == 0
    assert r.place("other", 10) == 1
    assert r.place("session", 500) == 0  # the second turn: same replica, though 0 is busier
    r.release("session")
    assert r.place("session", 1) == 1  # placed afresh: 1 has 10, 0 has 1000


def test_a_removed_replica_is_never_chosen_and_its_keys_move():
    r = Router(2)
    assert r.place("s", 5) == 0 and r.place("t", 1) == 1
    r.remove(0)
    assert r.place("s", 5) == 1 and r.alive == {1}  # "s" forgot replica 0
    r.remove(1)
    with pytest.raises(NoReplicaLeft):
        r.place("u", 1)


def test_sticky_keys_are_bounded_least_recently_used_first():
    r = Router(2, max_sticky=2)
    r.place("a", 0)
    r.place("b", 0)
    r.place("a", 0)  # "a" used last: "b" is the oldest
    r.place("c", 0)  # evicts "b"
    assert set(r._sticky) == {"a", "c"}


def test_concurrent_placements_keep_the_accounting():
    r = Router(4)

    def work(i):
        for j in range(200):
            replica = r.place((i, j), 7)
            r.finish(replica, 7)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.outstanding == [0, 0, 0, 0]
