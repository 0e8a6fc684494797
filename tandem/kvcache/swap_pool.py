"""The host block pool that preempted sequences swap their KV into: a free list of ids.

Mechanism only: the scheduler decides who swaps; this module keeps the books. The copies
themselves are :class:`tandem.kvcache.swap_copier.KVSwapper`'s.
"""

from __future__ import annotations

from collections import deque


class SwapPool:
    """``num_blocks`` host blocks, handed out least recently freed first (at start: by id).

    NOTE: the blocks in use never outnumber the device pool (``num_device_blocks``): every
    swapped block must have a device block to come back to.
    """

    def __init__(self, num_blocks: int, num_device_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_device_blocks = num_device_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return (num_blocks <= self.num_free_blocks
                and self.num_used_blocks + num_blocks <= self.num_device_blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        """-> ids of ``num_blocks`` host blocks. Call :meth:`can_allocate` first."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"not enough free host blocks for {num_blocks} (free: {self.num_free_blocks})")
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        assert self.num_used_blocks <= self.num_device_blocks, "more swapped blocks than the device pool"
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Give host blocks back (their sequence was swapped in, or ended while swapped)."""
        for block_id in block_ids:
            assert not self._is_free[block_id], f"host block {block_id} freed twice"
            self._is_free[block_id] = True
            self.free_block_ids.append(block_id)
