"""Blocks a prefix fetch passes through on either side (tier_peer.py, tier_fetch.py): a small
pool of the worker's block shape, on its pool's device, that the KV transfer layer reads from
(the serving side's sender) or writes into (the fetching side's receiver). Neither side's
engine pool is touched by a fetch in flight: a block is copied in before it is sent, and out
once it has arrived."""

from __future__ import annotations

import threading

import torch


class FetchStaging:
    """``num_blocks`` staging blocks shaped like ``block`` ([num_layers, 2, block_size,
    num_kv_heads, head_dim]), made on first use. Thread-safe."""

    def __init__(self, block: torch.Tensor, num_blocks: int) -> None:
        self._shape = (block.shape[0], block.shape[1], num_blocks, *block.shape[2:])
        self._dtype, self._device = block.dtype, block.device
        self._kv_cache: torch.Tensor | None = None
        self._free = list(range(num_blocks))
        self._lock = threading.Lock()

    @property
    def kv_cache(self) -> torch.Tensor:
        """The staging pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
        with self._lock:
            if self._kv_cache is None:
                self._kv_cache = torch.empty(self._shape, dtype=self._dtype, device=self._device)
            return self._kv_cache

    @property
    def num_blocks(self) -> int:
        return self._shape[2]

    @property
    def block_size(self) -> int:
        return self._shape[3]

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` free blocks (fewer when fewer are free), lowest ids first."""
        with self._lock:
            taken, self._free = self._free[:num_blocks], self._free[num_blocks:]
            return taken

    def give_back(self, block_ids: list[int]) -> None:
        with self._lock:
            assert not set(block_ids) & set(self._free), f"blocks {block_ids} given back twice"
            self._free = sorted(self._free + block_ids)
