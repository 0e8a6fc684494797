"""The sender's side of the in-place paths: a layer's rows copied once, from the sender's
pool straight into a same-node receiver's reserved slots, in order and under the fence.

Two kinds of target, one interface (InPlaceTarget): a pool in host shared memory mapped
here (shared_pool.MappedPool, path "shm") and a GPU pool opened by CUDA IPC
(cuda_ipc.DeviceTarget, path "cuda_ipc"). Both are fenced by a grant table in a host file.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from tandem.kvtransfer.fence import GrantFence
from tandem.kvtransfer.protocol import Destination, KVLayout
from tandem.kvtransfer.row_copy import Copier, row_copier
from tandem.kvtransfer.slots import contiguous_runs, covering_blocks, token_slots


class InPlaceTarget(Protocol):
    """A receiver's pool that this process writes into itself."""

    @property
    def path(self) -> str:
        """The data path it makes ("shm" or "cuda_ipc", path_choice.IN_PLACE_PATHS)."""
        ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def kv_cache(self) -> torch.Tensor:
        """The receiver's pool as this process sees it: in host memory, or on a GPU."""
        ...

    @property
    def fence(self) -> GrantFence:
        """The receiver's grant table: a write happens only inside fence.writing."""
        ...

    def owner_alive(self) -> bool:
        """Whether the receiver still holds the pool (its grant table's owner lock)."""

    def close(self) -> None:
        """Let go of the pool (the fence's descriptor at once; mappings with their tensors)."""


def device_copier(dst_slots: np.ndarray, src_slots: np.ndarray | None, dst_device: torch.device,
                  src_device: torch.device) -> Copier:
    """copy(dst, src) as row_copy.row_copier's, for pools on GPUs: one slice copy where both
    sides run side by side, else a gather of the source rows on their device and one
    index_copy_ into the destination, the indices uploaded once (here)."""
    n = len(dst_slots)
    src_slots = np.arange(n) if src_slots is None else src_slots
    if len(contiguous_runs(dst_slots)) == 1 and len(contiguous_runs(src_slots)) == 1:
        d, s = int(dst_slots[0]), int(src_slots[0])

        def copy_run(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst[:, d:d + n].copy_(src[:, s:s + n])
        return copy_run
    dst_index = torch.from_numpy(np.ascontiguousarray(dst_slots, dtype=np.int64)).to(dst_device)
    src_index = torch.from_numpy(np.ascontiguousarray(src_slots, dtype=np.int64)).to(src_device)

    def copy_indexed(dst: torch.Tensor, src: torch.Tensor) -> None:
        rows = src.index_select(1, src_index)
        dst.index_copy_(1, dst_index, rows.to(dst.device))  # (another GPU: by peer access)
    return copy_indexed


def synchronize(*devices: torch.device) -> None:
    """Wait for the work queued on the current streams of the GPUs among `devices`."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


class InPlaceWrites:
    """One request's rows, written into a same-node receiver's pool: each layer's tokens in
    order, only into the blocks granted to the request's reservation, under the fence."""

    def __init__(self, pool: InPlaceTarget, dest: Destination, src_block_size: int) -> None:
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
        _, blocks, copy = self._plan_for(start, end, src_block_ids, src.device)
        dst = self.pool.kv_cache[layer].flatten(1, 2)
        with self.pool.fence.writing(self.slot, dest.shm_grant, blocks) as granted:
            if granted:
                copy(dst, src)
                # NOTE: the fence: a device copy is asynchronous; it must be done before the lock
                # is released (a revoke returns only then), and before the header tells of it.
                synchronize(dst.device, src.device)
        if granted:
            written[layer] = end
        return granted

    def _plan_for(self, start: int, end: int, src_block_ids: Sequence[int] | None, src_device: torch.device
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
        dst_device = self.pool.kv_cache.device
        copier = (row_copier(dst_slots, src_slots) if dst_device.type == src_device.type == "cpu"
                  else device_copier(dst_slots, src_slots, dst_device, src_device))
        self._plan = (key, blocks, copier)
        return self._plan
