"""DAPO dynamic sampling: constant groups are dropped, rounds refill the batch, the result
is truncated to exactly the target, and the cap raises an error naming itself."""
import pytest

from asyncrl.runtime.dynamic_sampling import (DynamicSamplingCapError, ScoredGroups, collect_varied_groups,
                                              varied_groups)
from asyncrl.types import Completion, Example, RequestOutput


def _groups(correct: list[list[float]], tag: str = "") -> ScoredGroups:
    outputs = [RequestOutput([1], None, [Completion([2], f"{tag}{g}", [0.0], "stop") for _ in row])
               for g, row in enumerate(correct)]
    examples = [Example(f"{tag}{g}", "") for g in range(len(correct))]
    return ScoredGroups(examples, outputs, [list(row) for row in correct], [list(row) for row in correct])


def test_varied_groups_keeps_only_groups_whose_metric_varies():
    groups = _groups([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert varied_groups(groups, "acc") == [1, 3]
    single = _groups([[1], [0]])
    assert varied_groups(single, "acc") == [0, 1]  # a group of one is always kept (verl)


def test_score_metric_reads_the_shaped_score():
    groups = _groups([[1, 1], [0, 0]])
    groups.scores = [[1.0, 0.5], [0.0, 0.0]]  # same correctness, different length penalty
    assert varied_groups(groups, "acc") == []
    assert varied_groups(groups, "score") == [0]


def test_rounds_refill_until_the_target_then_truncate_in_order():
    rounds = [_groups([[1, 0], [1, 1], [0, 0]], "a"),      # keeps a0
              _groups([[0, 0], [0, 1], [1, 0]], "b")]      # keeps b1, b2
    calls = []

    def generate(r):
        calls.append(r)
        return rounds[r]

    kept, generated, metrics = collect_varied_groups(generate, target=2, metric="acc", max_rounds=10)
    assert calls == [0, 1]
    assert [ex.prompt for ex in kept.examples] == ["a0", "b1"]  # exactly 2, in generation order
    assert len(generated) == 6 and metrics["dynamic_sampling/rounds"] == 2.0
    assert metrics["dynamic_sampling/kept_group_fraction"] == pytest.approx(3 / 6)


def test_cap_raises_an_error_that_names_the_key_and_the_way_out():
    with pytest.raises(DynamicSamplingCapError) as err:
        collect_varied_groups(lambda r: _groups([[1, 1], [0, 1]]), target=3, metric="acc", max_rounds=2)
    message = str(err.value)
    assert "max_num_gen_batches=2" in message and "kept only 2 of the 3 groups" in message
    assert "filter_groups.enable=false" in message


def test_zero_cap_is_unlimited():
    rounds = [_groups([[1, 1]]) for _ in range(12)] + [_groups([[1, 0]])]
    kept, _, metrics = collect_varied_groups(lambda r: rounds[r], target=1, metric="acc", max_rounds=0)
    assert len(kept) == 1 and metrics["dynamic_sampling/rounds"] == 13.0
