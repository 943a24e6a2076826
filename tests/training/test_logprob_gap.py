import torch

from asyncrl.training.logprob_gap import LogprobGap, logprob_gap_metrics


def test_mean_is_token_weighted_across_micro_batches_and_ignores_padding():
    gap = LogprobGap()
    # micro 1: 3 response tokens with gaps 0.1, 0.2, 0.3 and a padded token with a huge gap
    gap.add(torch.tensor([[-1.0, -2.0, -3.0, 0.0]]), torch.tensor([[-1.1, -2.2, -3.3, -50.0]]),
            torch.tensor([[1, 1, 1, 0]]))
    # micro 2: 1 token with gap 0.6
    gap.add(torch.tensor([[-0.4]]), torch.tensor([[-1.0]]), torch.tensor([[1]]))
    m = gap.metrics()
    assert abs(m["rollout/logprob_gap"] - (0.1 + 0.2 + 0.3 + 0.6) / 4) < 1e-6
    assert abs(m["rollout/logprob_gap_max"] - 0.6) < 1e-6


def test_nothing_added_gives_no_metrics():
    assert LogprobGap().metrics() == {}
    assert logprob_gap_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3)) == {}
