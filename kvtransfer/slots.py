"""Where a request's tokens live in a paged pool, and which of them lie side by side."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def token_slots(block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, end: int,
                first_block: int = 0) -> np.ndarray:
    """Slots (block_id * block_size + offset) of tokens [start, end).

    block_ids[i] holds tokens [(first_block + i) * block_size, ...): a whole block table
    when first_block is 0, or the part of one that covers the range.
    """
    positions = np.arange(start, end)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size - first_block] * block_size + positions % block_size


def contiguous_runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """-> (first slot, length) of each run of consecutive slots, in order."""
    if len(slots) == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(slots)])))
    return [(int(slots[s]), int(n)) for s, n in zip(starts, lengths)]


def covering_blocks(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The blocks of a table that hold tokens [start, end)."""
    return list(block_ids[start // block_size: -(-end // block_size)])
