"""NgramProposer: drafts by prompt lookup, on hand-made token lists."""

from __future__ import annotations

import pytest

from tandem.decoding.ngram_proposer import NgramProposer


def test_proposes_what_followed_the_longest_matching_ngram():
    p = NgramProposer(max_ngram=3, min_ngram=1)
    # "1 2 3" occurred before, followed by 4 1 2 ...
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    # Only the 1-gram "9" matches (at 2); the 2-gram "8 9" does not.
    assert p.propose([5, 6, 9, 7, 7, 8, 9], 2) == [7, 7]


def test_prefers_the_most_recent_match_with_a_full_run_after_it():
    p = NgramProposer(max_ngram=2, min_ngram=2)
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert p.propose(tokens, 2) == [20, 21]
    assert p.propose(tokens, 4) == [20, 21, 1, 2]
    # Asking for 5: only the first match has 5 tokens after it.
    assert p.propose(tokens, 5) == [10, 11, 1, 2, 20]
    # Asking for 9: no match has 9 after it; the earliest gives the longest run.
    assert p.propose(tokens, 9) == [10, 11, 1, 2, 20, 21, 1, 2]


def test_no_match_or_too_short_gives_no_drafts():
    p = NgramProposer(max_ngram=4, min_ngram=2)
    assert p.propose([1, 2, 3, 4, 5], 3) == []
    assert p.propose([1, 2], 3) == []
    assert p.propose([1, 2, 1, 2], 0) == []
    # A 1-gram would match, but min_ngram is 2.
    assert p.propose([1, 9, 2, 1], 3) == []


def test_a_repeating_token_proposes_more_of_it():
    assert NgramProposer(max_ngram=2, min_ngram=1).propose([7] * 6, 3) == [7, 7, 7]


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=2, min_ngram=0)
