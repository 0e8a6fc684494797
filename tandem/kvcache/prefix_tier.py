"""Where full prefix blocks go when the pool evicts them, and come back from: the interface
the block manager calls (mechanism: it never touches a tensor), and what a tier counts.

A block is known by its chained hash (block_hash.py), which covers every token before it
and the request's cache_salt: a tier hit is the same prefix, computed by the same weights
(the tier's layout key, see disk_tier.py), so its KV is what recomputing would give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.kvcache.kv_events import KVEventLog

if TYPE_CHECKING:
    import torch


@dataclass
class TierCounters:
    """What one tier did since the engine started (read by the worker's metrics)."""

    num_offloaded_blocks: int = 0
    num_offloaded_bytes: int = 0
    offload_seconds: float = 0.0
    """Time the offloads took off the step's path (the writer thread's)."""
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    load_seconds: float = 0.0
    """Time the loads took on the step's path (they run inside the scheduler's admission)."""
    num_corrupt_blocks: int = 0
    """Blocks whose stored checksum did not match: dropped, and recomputed."""
    num_dropped_blocks: int = 0
    """Blocks dropped to stay within the tier's capacity (with no tier after it to take them)."""

    def loaded(self, num_bytes: int, seconds: float) -> None:
        """One block loaded back into the pool."""
        self.num_loaded_blocks += 1
        self.num_loaded_bytes += num_bytes
        self.load_seconds += seconds

    def offloaded(self, num_bytes: int) -> None:
        """One block kept by the tier (its time is counted where the copy runs)."""
        self.num_offloaded_blocks += 1
        self.num_offloaded_bytes += num_bytes


class PrefixTier(Protocol):
    """A store of evicted prefix blocks' KV, keyed by block hash."""

    counters: TierCounters
    name: str
    """The tier's name in metrics and KV events ("disk")."""
    events: KVEventLog | None
    """Where blocks entering and leaving the tier are recorded (None: nowhere)."""
    next_tier: PrefixTier | None
    """The tier after this one (host, then disk): where blocks go that this one has no room
    for, and where those it lacks are looked for (None: the last tier)."""

    def holds(self, block_hash: bytes) -> bool:
        """Whether ``block_hash``'s KV can be loaded (a load may still fail: a corrupt file)."""
        ...

    def offload(self, block_id: int, block_hash: bytes) -> None:
        """Keep pool block ``block_id``'s KV under ``block_hash``. Called just before the
        block is handed out again: its contents must be copied before this returns."""
        ...

    def offload_copy(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """Keep ``kv``, a block's KV already copied to the host ([num_layers, 2, block_size,
        num_kv_heads, head_dim]; the tier may keep the tensor itself), under ``block_hash``:
        how a tier passes blocks on to the next."""
        ...

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Write ``block_hash``'s KV into pool block ``block_id``. -> False when it cannot
        be (gone, or failing its checksum: then it is dropped); the block is then untouched
        or must be recomputed."""
        ...

    def block_hashes(self) -> list[bytes]:
        """Every block the tier can load now (a snapshot for the router's index)."""
        ...

    def close(self) -> None:
        """Finish the writes under way and stop."""
        ...


def tiers_of(tier: PrefixTier | None) -> list[PrefixTier]:
    """A chain of tiers, first to last (host, then disk)."""
    chain = []
    while tier is not None:
        chain.append(tier)
        tier = tier.next_tier
    return chain
