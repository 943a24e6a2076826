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
