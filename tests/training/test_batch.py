"""build_train_batch: prompts left-padded, responses right-padded, per-token fields aligned."""
import torch

from asyncrl.training.batch import build_train_batch
from asyncrl.types import Completion, RequestOutput


def test_rows_are_padded_and_aligned():
    outs = [RequestOutput([7, 8, 9], None, [Completion([4, 5], "", [-0.1, -0.2], "stop", [2, 3]),
                                             Completion([], "", None, "abort", [])]),
            RequestOutput([6], None, [Completion([1, 2, 3], "", [-0.3, -0.4, -0.5], "length", [3, 3, 3]),
                                      Completion([1], "", [-0.6], "stop", [1])])]
    b = build_train_batch(outs, [1.0, 0.0, 0.5, 0.25], pad_id=0, group_offset=5)
    assert b.prompt_length == 3
    assert b.input_ids.tolist() == [[7, 8, 9, 4, 5, 0], [7, 8, 9, 0, 0, 0], [0, 0, 6, 1, 2, 3], [0, 0, 6, 1, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert b.response_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]]
    torch.testing.assert_close(b.rollout_logprobs, torch.tensor(
        [[-0.1, -0.2, 0.0], [0.0, 0.0, 0.0], [-0.3, -0.4, -0.5], [-0.6, 0.0, 0.0]]))
    assert b.token_versions.tolist() == [[2, 3, -1], [-1, -1, -1], [3, 3, 3], [1, -1, -1]]
    assert b.group_ids.tolist() == [5, 5, 6, 6] and b.scores.tolist() == [1.0, 0.0, 0.5, 0.25]
    assert b.response_mask.dtype == torch.float32 and b.input_ids.dtype == b.token_versions.dtype == torch.long


def test_padding_equals_the_row_by_row_reference():
    """The vectorized padding (flat arrays scattered by masks) equals padding each row as a list,
    for ragged rows, empty responses and a one-token prompt."""
    import random

    from asyncrl.training.batch import _pad_rows, pad_prompt_response

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))] for _ in range(13)]
    responses = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))] for _ in range(13)]
    ids, attn, resp, plen = pad_prompt_response(prompts, responses, pad_id=99)
    P, L = max(map(len, prompts)), max(map(len, responses))
    assert plen == P and ids.shape == (13, P + L)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert ids[i].tolist() == [99] * (P - len(p)) + p + r + [99] * (L - len(r))
        assert attn[i].tolist() == [0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (L - len(r))
        assert resp[i].tolist() == [1.0] * len(r) + [0.0] * (L - len(r))
    rows = [[0.5] * 5, None, [1.5] * 2]  # a row longer than the width is cut
    assert _pad_rows(rows, 3, -1.0, torch.float32).tolist() == [[0.5] * 3, [-1.0] * 3, [1.5, 1.5, -1.0]]
