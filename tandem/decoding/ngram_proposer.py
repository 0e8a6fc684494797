"""Draft tokens by prompt lookup: no second model, only the sequence's own tokens.

When a sequence's last n tokens occurred before (in its prompt or its output), the tokens
that followed them then are a good guess for what follows now: text that is summarised,
edited or quoted copies long runs of its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (with a full run of tokens after it, when one has), trying n
    from ``max_ngram`` down to ``min_ngram``."""

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` tokens that may follow ``token_ids`` (none when no n-gram matches)."""
        num_tokens = len(token_ids)
        if num_drafts <= 0 or num_tokens <= self.min_ngram:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, num_tokens - 1), self.min_ngram - 1, -1):
            # Windows that start before the suffix itself; each ends before the last token,
            # so at least one token follows every match.
            windows = sliding_window_view(tokens[:-1], n)  # [num_tokens - n, n]
            match_starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if match_starts.size:
                # The most recent match followed by num_drafts tokens: a match right before the
                # end (a repeating loop) would leave only a token or two to propose.
                full = match_starts[match_starts + n + num_drafts <= num_tokens]
                start = int(full[-1] if full.size else match_starts[0]) + n
                return tokens[start:start + num_drafts].tolist()
        return []
