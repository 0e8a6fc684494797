"""The chained hash of a full KV block: torch-free, so that the router hashes prompts the
same way the workers' block managers do."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of a full block: equal hashes mean equal tokens *and* equal prefix.

    NOTE: stable across processes (unlike ``hash()``), so workers can compare prefixes.
    """
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent_hash + data, digest_size=16).digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a prompt's first block: empty, or the request's cache salt (so that
    salted prompts share blocks only with prompts of the same salt)."""
    return b"" if cache_salt is None else hashlib.blake2b(b"cache_salt:" + cache_salt.encode(), digest_size=16).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                  cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (default: all full blocks)."""
    num_full = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes, parent = [], root_hash(cache_salt)
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
