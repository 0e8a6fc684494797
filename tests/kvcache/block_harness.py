"""Sequences built by hand for the BlockManager tests, "computed" by moving
``num_computed_tokens`` forward as the scheduler's ``update`` does. Pure Python, no model."""

from __future__ import annotations

from tandem.engine.sequence import Sequence
from tandem.kvcache.block_manager import BlockManager
from tandem.sampling_params import SamplingParams

BS = 4  # block size of every test here


def make_seq(tokens: list[int], rid: str = "r", cache_salt: str | None = None) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(cache_salt=cache_salt), arrival_index=0)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None, cached: list[int] | None = None) -> None:
    """Allocate for and 'run' the next n tokens (all uncomputed ones by default)."""
    cached = cached or []
    n = seq.num_tokens - seq.num_computed_tokens - len(cached) * BS if n is None else n
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def free_list(bm: BlockManager) -> list[int]:
    return list(bm.free_block_ids)


def toks(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))
