"""N-gram prompt lookup: the longest matching suffix, its latest earlier occurrence, the tokens after it."""

import pytest

from servescope.spec.ngram import NgramProposer


def test_longest_suffix_wins_over_a_later_shorter_match():
    p = NgramProposer(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3]  # suffix [1, 2, 3] occurs at 0..2; [3] alone also at 6
    assert p.propose(seq, 3) == [4, 5, 9]


def test_latest_occurrence_among_equal_lengths():
    p = NgramProposer(2, 2)
    seq = [7, 8, 1, 7, 8, 2, 7, 8]
    assert p.propose(seq, 2) == [2, 7]


def test_no_match_below_min_and_k_cut():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5, 3], 4) == []  # only a 1-token match, min is 2
    assert p.propose([4, 5, 6, 4, 5], 1) == [6]
    assert p.propose([4, 5, 6, 4, 5], 0) == []
    assert p.propose([4, 5, 4, 5], 5) == [4, 5]  # the proposal stops at the end of the sequence
    assert p.propose([3], 2) == []


def test_bad_bounds():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
