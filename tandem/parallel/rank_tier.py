"""The KV tiers of a tensor-parallel pool, as its first rank's block manager sees them.

Each rank's pool holds its share of the KV heads, but a tier keeps whole blocks (every
head: the layout of a tp=1 pool, so workers of any tensor-parallel size share the disk
tier's files). Nothing writes a rank's pool between step messages, so the tier works
through them (step_message.py):

- a block the pool evicts is gathered from every rank at the start of the next message,
  before that message writes anything (``StepMessage.gather_blocks``), and only then kept
  by the tier;
- a load reads the whole block into a one-block host buffer and queues it as KV writes
  (kv_writes.py), which the next message carries to every rank before its forward, as it
  carries KV another worker sent.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.kvcache.kv_events import KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier
from tandem.parallel.kv_writes import PendingKVWrites
from tandem.parallel.step_message import HOST


class RankTier:
    """A PrefixTier over the chain ``first`` (built over ``staging``, a one-block pool of
    every head, [num_layers, 2, 1, block_size, num_kv_heads, head_dim] on the host). Its
    name, counters and next tier are the first tier's: metrics and KV events see the chain
    as it is."""

    def __init__(self, first: PrefixTier, staging: torch.Tensor, kv_writes: PendingKVWrites) -> None:
        self.first = first
        self.staging = staging
        self.kv_writes = kv_writes
        self.name = first.name
        self.counters = first.counters
        self.next_tier = first.next_tier
        self._offloads: list[tuple[int, bytes]] = []
        """Blocks evicted since the last message (pool block id, hash): gathered with the next."""
        self._loaded: set[int] = set()
        """Blocks loaded since the last message: their rows wait in kv_writes, not yet in the pool."""

    @property
    def events(self) -> KVEventLog | None:
        return self.first.events

    @events.setter
    def events(self, log: KVEventLog | None) -> None:
        self.first.events = log

    def holds(self, block_hash: bytes) -> bool:
        return self.first.holds(block_hash)

    def offload(self, block_id: int, block_hash: bytes) -> None:
        """Keep ``block_id`` under ``block_hash`` once the next message has gathered it.
        NOTE: the block manager may hand the block out at once: its next owner's KV reaches
        the ranks in a later message, or later in that one, after the gather."""
        if block_id in self._loaded:
            return  # just loaded from the tier, which still has it: its rows are not in the pool yet
        self._offloads.append((block_id, block_hash))

    def offload_copy(self, block_hash: bytes, kv: torch.Tensor) -> None:
        raise AssertionError("a tensor-parallel pool's tiers start with this one")

    def load(self, block_hash: bytes, block_id: int) -> bool:
        if any(h == block_hash for _, h in self._offloads):
            return False  # evicted since the last message, not gathered yet: recomputed instead
        if not self.first.load(block_hash, 0):
            return False
        block_size = self.staging.shape[3]
        slots = block_id * block_size + np.arange(block_size)
        for layer in range(self.staging.shape[0]):
            for kv in range(2):
                # rows: [block_size, num_kv_heads, head_dim] (the sink copies them)
                self.kv_writes.write(layer, kv, slots, [self.staging[layer, kv, 0]])
        self._loaded.add(block_id)
        return True

    def block_hashes(self) -> list[bytes]:
        return self.first.block_hashes()

    def close(self) -> None:
        self.first.close()

    @property
    def has_offloads(self) -> bool:
        return bool(self._offloads)

    def take_offloads(self) -> list[tuple[int, bytes]]:
        """The blocks the next message gathers (then none are waiting); the loads queued so
        far go out with it too."""
        offloads, self._offloads = self._offloads, []
        self._loaded.clear()
        return offloads

    def store_gathered(self, offloads: list[tuple[int, bytes]], gathered: torch.Tensor) -> None:
        """Keep what the message gathered: ``gathered`` [num_layers, 2, num_blocks,
        block_size, num_kv_heads, head_dim], ``offloads``' blocks in order."""
        for i, (_, block_hash) in enumerate(offloads):
            self.first.offload_copy(block_hash, gathered[:, :, i].contiguous().to(HOST))
