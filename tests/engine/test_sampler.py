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
