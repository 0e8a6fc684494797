"""The scheduler's preemption mechanics: swap a sequence's KV out to the host pool and back,
or drop it to be recomputed. Which sequence, and when, is the scheduler's policy."""

from __future__ import annotations

import bisect
import logging
from collections import deque

from tandem.config import EngineConfig
from tandem.engine.preemption import should_swap
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.swap_pool import SwapPool

logger = logging.getLogger(__name__)


class PreemptionMixin:
    """Part of Scheduler (the attributes below are its own)."""

    config: EngineConfig
    block_manager: BlockManager
    swap_pool: SwapPool
    waiting: deque[Sequence]
    swapped: deque[Sequence]
    num_preemptions: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int

    def _preempt(self, seq: Sequence) -> list[tuple[int, int]]:
        """Swap ``seq`` out or drop its KV, as the policy says. -> the blocks to swap out."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        num_blocks = self.block_manager.num_blocks_for(seq.num_computed_tokens)
        # NOTE: beams are not swapped: forking a beam needs its KV on the device.
        if (should_swap(self.config.preemption_mode, num_blocks) and self.can_swap_out(seq)
                and not seq.params.use_beam_search):
            return self.swap_out(seq)
        self._recompute(seq)
        return []

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.swap_pool.can_allocate(self.block_manager.num_blocks_for(seq.num_computed_tokens))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Preemption by swap: give ``seq``'s computed KV host blocks, free its device blocks.
        -> (device, host) block pairs to copy. Call :meth:`can_swap_out` first."""
        num_blocks = self.block_manager.num_blocks_for(seq.num_computed_tokens)
        seq.host_block_ids = self.swap_pool.allocate(num_blocks)
        block_pairs = list(zip(seq.block_ids[:num_blocks], seq.host_block_ids))
        # NOTE: drops only this sequence's references: a prefix block shared with another
        # sequence stays where it is, and a cached one keeps its contents until reused.
        self.block_manager.free(seq)
        seq.status = SequenceStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=lambda s: s.arrival_index)
        self.num_swapped_out_blocks += num_blocks
        logger.debug("swapped out %s: %d blocks", seq.request_id, num_blocks)
        return block_pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.block_manager.can_allocate(seq, num_new_tokens)

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give swapped ``seq`` fresh device blocks for its KV and ``num_new_tokens`` more
        tokens. -> (host, device) block pairs to copy. Call :meth:`can_swap_in` first."""
        # Its block table is empty: the first blocks allocated take the swapped KV, in order.
        self.block_manager.allocate(seq, num_new_tokens)
        block_pairs = list(zip(seq.host_block_ids, seq.block_ids))
        self.swap_pool.free(seq.host_block_ids)
        seq.host_block_ids = []
        seq.status = SequenceStatus.RUNNING
        self.num_swapped_in_blocks += len(block_pairs)
        logger.debug("swapped in %s: %d blocks", seq.request_id, len(block_pairs))
        return block_pairs

    def _recompute(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, run the tokens again later."""
        logger.debug("preempting %s by recompute", seq.request_id)
        if seq.group is not None:  # a beam samples again once recomputed
            seq.group.candidates.pop(id(seq), None)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
