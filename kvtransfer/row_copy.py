"""Rows of one paged pool copied into the slots of another in a few large torch ops, never a
Python loop per token: the sender's one copy on the shared-memory path (in_place.py)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

MAX_RUNS = 8  # more runs than this (scattered blocks) and indexed copies beat a copy per run

Copier = Callable[[torch.Tensor, torch.Tensor], None]
"""copy(dst, src): K and V rows ([2, rows, heads, dim]) of src into those of dst, as row_copier planned."""
Run = tuple[int, int, int]
"""(first destination row, first source row, rows) of a stretch that counts up by one on both sides."""


def row_copier(dst_slots: np.ndarray, src_slots: np.ndarray | None) -> Copier:
    """-> copy(dst, src): dst[:, dst_slots[i]] = src[:, src_slots[i]] (src[:, i] without
    src_slots), K and V alike.

    A few long stretches: plain copies of K and V at once. NOTE: few large ops: each
    parallel op waits for its slowest thread, and on a busy host that wait dominates.
    Scattered: indexed copies in units as large as the stretches allow (a block, when both
    pools have one block size; one row at worst), the range's partial first and last
    stretches by plain copies.
    """
    n = len(dst_slots)
    src_slots = np.arange(n) if src_slots is None else src_slots
    starts = np.concatenate(([0], np.flatnonzero((np.diff(dst_slots) != 1) | (np.diff(src_slots) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [n])))
    dst_first, src_first = dst_slots[starts], src_slots[starts]
    if len(starts) <= MAX_RUNS:
        return _plain_copier(_runs(dst_first, src_first, lengths))
    # The largest unit every inner stretch is made of, on both sides.
    unit = int(np.gcd.reduce(np.concatenate((lengths[1:-1], dst_first[1:-1], src_first[1:-1]))))
    whole = (lengths % unit == 0) & (dst_first % unit == 0) & (src_first % unit == 0)
    counts = lengths[whole] // unit
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return _indexed_copier(np.repeat(dst_first[whole] // unit, counts) + offsets,
                           np.repeat(src_first[whole] // unit, counts) + offsets, unit,
                           _runs(dst_first[~whole], src_first[~whole], lengths[~whole]))


def _runs(dst_first: np.ndarray, src_first: np.ndarray, lengths: np.ndarray) -> list[Run]:
    return [(int(d), int(s), int(length)) for d, s, length in zip(dst_first, src_first, lengths)]


def _plain_copier(runs: list[Run]) -> Copier:
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        for d, s, length in runs:
            dst[:, d:d + length].copy_(src[:, s:s + length])
    return copy


def _indexed_copier(dst_units: np.ndarray, src_units: np.ndarray, unit: int, odd: list[Run]) -> Copier:
    """Units (`unit` rows each) src_units[i] to dst_units[i], then the odd runs: one pass
    where one side's units lie side by side (index_copy_, or index_select into them), else a
    gather then a scatter."""
    num_units = len(dst_units)
    d0, s0 = int(dst_units[0]), int(src_units[0])
    src_together, dst_together = bool((np.diff(src_units) == 1).all()), bool((np.diff(dst_units) == 1).all())
    dst_index, src_index = torch.from_numpy(dst_units), torch.from_numpy(src_units)
    copy_odd = _plain_copier(odd)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        for d, s in zip(dst, src):  # K and V each, indexed along dim 0: along dim 1 of both torch is slower
            d, s = _in_units(d, unit), _in_units(s, unit)
            if src_together:  # e.g. a fresh sender pool, or given rows
                d.index_copy_(0, dst_index, s[s0:s0 + num_units])
            elif dst_together:
                torch.index_select(s, 0, src_index, out=d[d0:d0 + num_units])
            else:
                d.index_copy_(0, dst_index, s.index_select(0, src_index))
        copy_odd(dst, src)
    return copy


def _in_units(rows: torch.Tensor, unit: int) -> torch.Tensor:
    """[rows, ...] -> [rows // unit, unit, ...], a view (a last part unit is left out)."""
    return rows.narrow(0, 0, len(rows) // unit * unit).unflatten(0, (-1, unit))
