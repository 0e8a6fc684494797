"""What an engine holds and has done, read between steps: what its worker reports (load to
the router, inventory to leak checks, counters to metrics) without reaching into the
scheduler, the block manager or the swap pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is, for routing and gauges: cheap to read (no scan of the pool)."""

    num_requests: int
    """Requests the engine holds: waiting, running, swapped, or reserved for a prefill elsewhere."""
    num_waiting: int
    """Sequences waiting to be scheduled."""
    num_running: int
    """Sequences in the running batch."""
    num_queued_tokens: int
    """Tokens of the waiting sequences still to compute."""
    num_blocks: int
    num_free_blocks: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


@dataclass(frozen=True)
class EngineInventory:
    """Everything the engine holds for requests: an engine at rest (every request ended)
    holds nothing, every count 0 and every block free."""

    num_requests: int
    num_waiting: int
    num_running: int
    num_reserved: int
    """Requests holding blocks for KV computed elsewhere, not started yet (reserve_prefilled)."""
    num_blocks: int
    num_free_blocks: int
    num_referenced_blocks: int
    """Blocks with a nonzero reference count."""
    num_swapped_blocks: int
    """Host blocks holding swapped-out KV."""


@dataclass(frozen=True)
class EngineCounters:
    """Counts since the engine started (never go down)."""

    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_draft_tokens: int
    """Draft tokens verified by speculative decoding."""
    num_accepted_draft_tokens: int
