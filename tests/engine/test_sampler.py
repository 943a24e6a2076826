"""sampler.py: the Gumbel noise stays finite, so a race follows the logits."""
import torch

from asyncrl.engine.sampler import Sampler, _mix32, gumbel_noise, row_keys, sample

# seed 173 (sample 0, position 173) hashes vocab index 21804 to (x >> 8) == 2^24 - 1,
# whose u = ((2^24 - 1) + 0.5) / 2^24 rounds to 1.0 in fp32
SEED, INDEX = 173, 21804


def _key():
    s = torch.tensor([SEED], dtype=torch.int64)
    return row_keys(s, torch.zeros(1, dtype=torch.int64), s)


def test_the_edge_index_hashes_to_the_top_bucket():
    k, v = _key(), torch.tensor([INDEX], dtype=torch.int64)
    x = _mix32(_mix32(k * 0x9E3779B1 + v) ^ (k >> 7))
    assert (x >> 8).item() == 2**24 - 1  # the case the clamp exists for


def test_noise_is_finite_at_the_top_bucket():
    g = gumbel_noise(_key(), INDEX + 1)
    assert torch.isfinite(g).all()
    assert 16 < g[0, INDEX].item() < 17  # -log(-log(1 - 2^-24)) = 16.6: large, not +inf


def test_race_follows_the_logits_at_the_top_bucket():
    """A token 30 nats above the rest wins (unclamped, +inf noise picked INDEX instead)."""
    V = 32000
    logits = torch.zeros(1, V)
    logits[0, 5] = 30.0
    tok, lp = sample(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), _key(), False)
    assert tok.item() == 5
    assert lp.item() > -1e-3


def test_cpu_sampler_keeps_the_torch_path():
    assert Sampler(torch.device("cpu"), compile=True, triton=True).fast is None


def test_top_p_one_row_keeps_its_tail_in_a_filtered_batch():
    """A batch with one top-p row filters every row; a row with top_p = 1 must keep all tokens
    even where the fp32 cumulative mass reaches 1.0 before its tail (one dominant token)."""
    from asyncrl.engine.sampler import _mask_top_k_top_p

    logits = torch.full((2, 5000), -20.0)
    logits[:, 0] = 10.0  # the other 4,999 tokens hold ~1e-13 each: the cumsum rounds to 1.0
    out = _mask_top_k_top_p(logits.clone(), torch.tensor([0, 0]), torch.tensor([1.0, 0.9]))
    assert torch.isfinite(out[0]).all()  # unfiltered row: nothing dropped
    assert torch.isinf(out[1]).sum() == 4999  # top_p 0.9: only the dominant token survives


def test_runner_sampling_keys_equal_row_keys_as_the_batch_changes():
    """``ModelRunner._sample_arrays`` keeps the rows' sequence keys while the rows are the same
    sequences, and a uniform batch's sampling arrays while its params are equal: its arrays equal
    ``row_keys`` of each step's (seed, sample index, position) and the rows' params through a run
    whose batch gains, loses and reorders sequences (a new one in the place of another, same row
    count), mixes two params objects, and sees a params object changed in place."""
    import types

    import numpy as np

    from asyncrl.engine.model_runner import ModelRunner
    from asyncrl.engine.scheduler import ScheduledBatch
    from asyncrl.engine.sequence import Sequence
    from asyncrl.types import SamplingParams

    params, other = SamplingParams(temperature=0.7), SamplingParams(temperature=0.5, top_k=3)
    pool = [Sequence([1, 2], params, str(i), i % 3, 1000 + 17 * i) for i in range(6)]
    pool.append(Sequence([1, 2], other, "6", 0, 5))
    runner = types.SimpleNamespace(_keys_of=None, _uniform_of=None)
    runner._sequence_keys = ModelRunner._sequence_keys.__get__(runner)
    batches = [[0, 1, 2], [0, 1, 2], [0, 1, 2, 3], [1, 2, 3], [1, 2, 4], [2, 1, 4], [5], [5], [5, 6], [0, 1],
               [0, 1]]
    for step, rows in enumerate(batches):
        if step == 10:
            params.top_p = 0.5  # a SamplingParams object changed between steps: read by value
        seqs = [pool[i] for i in rows]
        positions = [10 + step + i for i in range(len(seqs))]
        batch = ScheduledBatch(seqs=seqs, is_prefill=False, sample_seqs=seqs, key_positions=positions)
        (floats, ints), use_filter = ModelRunner._sample_arrays(runner, batch)
        want = row_keys(np.array([s.seed for s in seqs]), np.array([s.sample_index for s in seqs]),
                        np.array(positions))
        assert ints[0].tolist() == want.tolist()
        assert floats.tolist() == [[np.float32(s.params.temperature) for s in seqs],
                                   [np.float32(s.params.top_p) for s in seqs]]
        assert ints[1].tolist() == [s.params.top_k for s in seqs]
        assert use_filter == any(s.params.top_k > 0 or s.params.top_p < 1 for s in seqs)
