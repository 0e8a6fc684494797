"""The sender's side of the shared-memory path: a layer's rows copied once, from the sender's
pool straight into a same-node receiver's reserved slots, in order and under the fence."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tandem.kvtransfer.protocol import Destination
from tandem.kvtransfer.row_copy import Copier, row_copier
from tandem.kvtransfer.shared_pool import MappedPool
from tandem.kvtransfer.slots import covering_blocks, token_slots


class InPlaceWrites:
    """One request's rows, written into a same-node receiver's pool: each layer's tokens in
    order, only into the blocks granted to the request's reservation, under the fence."""

    def __init__(self, pool: MappedPool, dest: Destination, src_block_size: int) -> None:
        """src_block_size: tokens per block of the pool the rows come from."""
        bs = pool.layout.block_size
        if not 0 <= dest.num_cached_tokens // bs < len(dest.block_ids) \
                or not 0 <= dest.block_ids[dest.num_cached_tokens // bs] < pool.layout.num_blocks:
            raise ValueError(f"{dest.request_id}: no block of the pool in {dest.block_ids} after its "
                             f"{dest.num_cached_tokens} cached tokens")
        self.pool = pool
        self.dest = dest
        self.src_block_size = src_block_size
        self.written = [dest.num_cached_tokens] * pool.layout.num_layers
        """Tokens in place so far, per layer."""
        # The reservation's slot: its first block after the receiver's cached prefix (fence.granted_blocks).
        self.slot = dest.block_ids[dest.num_cached_tokens // bs]
        self._plan: tuple[tuple, np.ndarray, Copier] | None = None
        """(its key, blocks, copier) for the latest token range and source: every layer writes the same."""

    def write(self, layer: int, start: int, end: int, src: torch.Tensor, src_block_ids: Sequence[int] | None) -> bool:
        """Copy layer `layer`'s K and V of tokens [start, end) into the request's slots.

        src: [2 (K, V), rows, heads, dim] to read: a layer of the source pool (its
        kv_cache[layer].flatten(1, 2)), whose blocks `src_block_ids` hold the request's
        tokens, or (None) the range's rows in order.
        -> False, writing nothing, when the blocks are not granted to the reservation (the
        receiver revoked it, or the destination names blocks that are not its own).
        ValueError when the range does not continue the layer's (the receiver's rule too),
        or the blocks cannot hold it.
        """
        dest, written = self.dest, self.written
        if start != written[layer] or not start < end <= dest.num_tokens:
            raise ValueError(f"{dest.request_id}: layer {layer} tokens [{start}, {end}) do not follow the "
                             f"{written[layer]} in place (of {dest.num_tokens})")
        _, blocks, copy = self._plan_for(start, end, src_block_ids)
        with self.pool.fence.writing(self.slot, dest.shm_grant, blocks) as granted:
            if granted:
                copy(self.pool.kv_cache[layer].flatten(1, 2), src)
        if granted:
            written[layer] = end
        return granted

    def _plan_for(self, start: int, end: int, src_block_ids: Sequence[int] | None
                  ) -> tuple[tuple, np.ndarray, Copier]:
        """Where tokens [start, end) go, and how to copy them there (planned once for every
        layer, and before the lock is taken: it is held only while bytes move)."""
        key = (start, end, None if src_block_ids is None else tuple(src_block_ids))
        if self._plan is not None and self._plan[0] == key:
            return self._plan
        layout, dest = self.pool.layout, self.dest
        blocks = np.asarray(covering_blocks(dest.block_ids, layout.block_size, start, end), dtype=np.int64)
        if len(blocks) != -(-end // layout.block_size) - start // layout.block_size \
                or not ((0 <= blocks) & (blocks < layout.num_blocks)).all():
            raise ValueError(f"{dest.request_id}: blocks {dest.block_ids} do not hold tokens [{start}, {end}) "
                             "in the pool")
        dst_slots = token_slots(blocks, layout.block_size, start, end, start // layout.block_size)
        src_slots = None if src_block_ids is None else token_slots(src_block_ids, self.src_block_size, start, end)
        self._plan = (key, blocks, row_copier(dst_slots, src_slots))
        return self._plan
