import pytest
import torch

from asyncrl.algorithms import filter_groups, overlong_penalty


def test_overlong_hand_values():
    # L_max = 20480, L_buf = 4096, f = 1: penalty starts at 16384
    # |o| = 18432: exceed = 2048 -> −2048/4096 = −0.5
    lengths = torch.tensor([100, 16384, 18432, 20480])
    out = overlong_penalty(lengths, max_response_length=20480, buffer_length=4096, penalty_factor=1.0)
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_overlong_scales_with_factor_and_is_bounded():
    # past L_max the penalty stays at −f (generation is capped there anyway)
    out = overlong_penalty(torch.tensor([18432, 30000]), 20480, 4096, penalty_factor=0.5)
    assert out.tolist() == [-0.25, -0.5]
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 10, 0, 1.0)


def test_overlong_penalty_of_integer_lengths_is_float64():
    # L_max = 10, L_buf = 3, f = 0.1: |o| = 9 -> exceed = 2 -> −2/3·0.1, the Python-float value
    # verl computes (float32 would give −0.06666667014)
    out = overlong_penalty(torch.tensor([9]), 10, 3, penalty_factor=0.1)
    assert out.dtype == torch.float64 and out.item() == -2 / 3 * 0.1


def test_filter_groups_by_hand():
    # group 5: all correct (drop); group 2: mixed (keep); group 9: all wrong (drop); group 4: singleton (keep)
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    gids = torch.tensor([5, 5, 2, 2, 9, 9, 4])
    assert filter_groups(metric, gids).tolist() == [False, False, True, True, False, False, True]


def test_filter_groups_constant_float_metric_is_dropped_exactly():
    # 0.1 three times has np.std ≈ 1.4e-17 > 0 from round-off; max > min says constant
    assert not filter_groups(torch.tensor([0.1, 0.1, 0.1]), torch.zeros(3, dtype=torch.long)).any()
