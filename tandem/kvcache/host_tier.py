"""The host tier: evicted prefix blocks of an accelerator's pool kept in host memory, ahead of
the disk tier.

One preallocated host tensor holds ``capacity_blocks`` blocks (pinned on CUDA, so copies run
asynchronously on the pool's stream); a block's slot is found by its hash. An offload copies
the pool block into a slot on the device's stream, before the block is handed out again: the
step that overwrites it is queued after the copy, so the step never waits for it. When the
slots run out, the least recently used block moves on to the next tier (the disk, when there
is one) and its slot is reused. A load copies a slot back into a pool block, the same way;
a block the host tier lacks is asked of the next tier.

A CPU pool has no host tier: its pool already is host memory (give it that memory instead),
and its evictions go straight to the disk tier.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from tandem.kvcache.kv_events import BlockEventKind, KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier, TierCounters


class HostTier:
    """A PrefixTier in host memory over pool ``kv_cache`` (see the module docstring).

    kv_cache: the pool, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
    next_tier: where blocks go when the slots run out, and are looked for after these."""

    name = "host"

    def __init__(self, kv_cache: torch.Tensor, capacity_bytes: int, next_tier: PrefixTier | None = None) -> None:
        self.kv_cache = kv_cache
        self.next_tier = next_tier
        self.events: KVEventLog | None = None
        """Where blocks entering and leaving the tier are recorded (None: nowhere)."""
        block = kv_cache[:, :, 0]  # [num_layers, 2, block_size, num_kv_heads, head_dim]
        self.block_bytes = block.numel() * block.element_size()
        self.capacity_blocks = max(capacity_bytes // self.block_bytes, 0)
        self._asynchronous = kv_cache.device.type == "cuda"
        # store: [capacity_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.store = torch.empty((self.capacity_blocks, *block.shape), dtype=kv_cache.dtype, device="cpu",
                                 pin_memory=self._asynchronous)
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        """Block hash -> its slot in store, least recently used first."""
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        self._copied: dict[int, Any] = {}
        """Slot -> the CUDA event after its device-to-host copy (read before the host reads it)."""
        self.counters = TierCounters()

    # -- PrefixTier ---------------------------------------------------------------------

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._slots or (self.next_tier is not None and self.next_tier.holds(block_hash))

    def offload(self, block_id: int, block_hash: bytes) -> None:
        self._keep(block_hash, self.kv_cache[:, :, block_id])

    def offload_copy(self, block_hash: bytes, kv: torch.Tensor) -> None:
        self._keep(block_hash, kv)

    def _keep(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """kv: [num_layers, 2, block_size, num_kv_heads, head_dim], a pool block or a copy."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if self.capacity_blocks == 0:
            if self.next_tier is not None:
                self.next_tier.offload_copy(block_hash, kv.to("cpu", copy=True))
            return
        started = time.perf_counter()
        slot = self._free_slots.pop() if self._free_slots else self._spill_oldest()
        asynchronous = self._asynchronous and kv.is_cuda
        if self._asynchronous and not asynchronous:
            torch.cuda.current_stream().synchronize()  # a load queued from this slot may not have read it yet
        self.store[slot].copy_(kv, non_blocking=asynchronous)
        if asynchronous:
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()
        self._slots[block_hash] = slot
        self.counters.offloaded(self.block_bytes)
        self.counters.offload_seconds += time.perf_counter() - started
        if self.events is not None:
            self.events.record(BlockEventKind.STORED, block_hash, self.name)

    def load(self, block_hash: bytes, block_id: int) -> bool:
        slot = self._slots.get(block_hash)
        if slot is None:
            return self.next_tier is not None and self.next_tier.load(block_hash, block_id)
        started = time.perf_counter()
        self.kv_cache[:, :, block_id].copy_(self.store[slot], non_blocking=self._asynchronous)
        self._slots.move_to_end(block_hash)
        self.counters.loaded(self.block_bytes, time.perf_counter() - started)
        return True

    def block_hashes(self) -> list[bytes]:
        """The blocks in host memory (the next tier lists its own)."""
        return list(self._slots)

    def close(self) -> None:
        if self.next_tier is not None:
            self.next_tier.close()

    # -- slots --------------------------------------------------------------------------

    def _spill_oldest(self) -> int:
        """Free the least recently used slot, its block passed on to the next tier -> the slot."""
        block_hash, slot = self._slots.popitem(last=False)
        event = self._copied.pop(slot, None)
        if event is not None:
            event.synchronize()  # its device-to-host copy must be done before the host reads it
        if self.next_tier is not None:
            self.next_tier.offload_copy(block_hash, self.store[slot].clone())
        else:
            self.counters.num_dropped_blocks += 1
        if self.events is not None:
            self.events.record(BlockEventKind.REMOVED, block_hash, self.name)
        return slot

