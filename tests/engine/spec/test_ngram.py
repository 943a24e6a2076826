"""n-gram drafting (spec/ngram.py): what ``lookup`` proposes, worked out by hand."""
import numpy as np

from asyncrl.engine.spec.ngram import lookup


def _look(tokens, k, n_max=3, n_min=1, others=()):
    return lookup(np.array(tokens), k, n_max, n_min, tuple(np.array(o) for o in others)).tolist()


def test_the_tokens_after_the_most_recent_longest_match():
    # suffix [1, 2] last seen at 3 (followed by 9, 5), earlier at 0 (followed by 7)
    assert _look([1, 2, 7, 1, 2, 9, 5, 1, 2], k=2) == [9, 5]
    assert _look([1, 2, 7, 1, 2, 9, 5, 1, 2], k=5) == [9, 5, 1, 2, 9]  # past the end: the pattern again


def test_a_repeated_token_proposes_k_drafts():
    """The most recent match of a repeating text overlaps the suffix: the continuation is copied
    with the overlap (one token repeated -> k copies), not cut at the sequence's end."""
    assert _look([4, 8, 8, 8, 8], k=4) == [8, 8, 8, 8]
    assert _look([5, 1, 2, 3, 1, 2, 3], k=5) == [1, 2, 3, 1, 2]  # period 3


def test_sibling_samples_are_searched_when_the_sequence_has_no_match():
    assert _look([1, 2, 3], k=2, others=([6, 2, 3, 4, 5],)) == [4, 5]
    assert _look([1, 2, 3], k=2, others=([6, 7],)) == []


def test_find_is_the_last_whole_match_before_the_limit():
    """``_find`` (candidates narrowed token by token) against the plain definition, on random
    short sequences over a 3-token alphabet (many overlapping matches)."""
    from asyncrl.engine.spec.ngram import _find

    rng = np.random.default_rng(0)
    for _ in range(2000):
        hay, needle = rng.integers(0, 3, rng.integers(1, 40)), rng.integers(0, 3, rng.integers(1, 5))
        before = int(rng.integers(0, len(hay) + 1))
        starts = [i for i in range(before - len(needle) + 1) if hay[i:i + len(needle)].tolist() == needle.tolist()]
        assert _find(hay, needle, before) == (starts[-1] if starts else -1)


def test_token_buffers_follow_growing_sequences():
    """The proposer's per-sequence numpy copy of ``token_ids`` grows with it (past its capacity)."""
    from types import SimpleNamespace

    from asyncrl.engine.spec.ngram import NgramProposer

    proposer, seq = NgramProposer(4, 3, 1), SimpleNamespace(seq_id=7, token_ids=[1, 2])
    for n in range(3, 300, 7):
        seq.token_ids = seq.token_ids + list(range(len(seq.token_ids), n))
        assert proposer._tokens(seq).tolist() == seq.token_ids
