"""training/draft_replay.py: the round walk by hand (the engine-side equality is
tests/engine/spec/test_eagle.py::test_engine_acceptance_equals_the_offline_replay)."""
import numpy as np

from asyncrl.training.draft_replay import walk_rounds


def test_rounds_stop_at_the_first_miss_and_restart_after_the_bonus_token():
    # k = 2, a sample of 9 tokens whose first round starts at L = 3 (prompt 2 + the prefill's token)
    hits = np.zeros((2, 9), dtype=bool)
    hits[0, [2, 5]] = True   # pass 1 right at positions 2 and 5
    hits[1, [3]] = True      # pass 2 right at position 3
    # round L=3: drafts at 2 (hit), 3 (hit) -> 2 accepted, L = 6; round L=6: draft at 5 (hit),
    # pass 2 at 6 misses -> 1 accepted, L = 8; round L=8: budget min(2, 9 - 8 - 1) = 0, L = 9
    assert walk_rounds(hits, start=3, end=9, k=2) == (3, 4, 3)


def test_no_hits_emit_one_token_per_round():
    hits = np.zeros((3, 10), dtype=bool)
    # rounds at L = 4..9: budgets 3, 3, 3, 2, 1, 0
    assert walk_rounds(hits, start=4, end=10, k=3) == (6, 12, 0)
