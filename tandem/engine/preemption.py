"""Preemption: how a running sequence gives its device blocks back when they run out (its KV
swapped out to host memory, or dropped to be recomputed), and how a swapped one comes back.

Which sequence, and when, is the scheduler's policy; so is the queue it waits in next.
"""

from __future__ import annotations

import logging

from tandem.config import EngineConfig
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.swap_pool import SwapPool

logger = logging.getLogger(__name__)

SWAP_MIN_BLOCKS = 1
"""In ``auto`` mode, sequences holding at least this many computed blocks are swapped.

Measured with ``tandem bench swap --num-threads 1`` (SmolLM2-135M, float32, block size 16,
one CPU thread, a busy 2-core machine): swapping N blocks out and back in took 0.18, 1.81,
18.5 and 58.2 ms for N = 1, 4, 16, 64, while recomputing their tokens added 61, 233, 856
and 3491 ms to a step of 8 decodes (context 256; the step alone: 99 ms). Swapping is
cheaper from one block on (40x to 450x; a second run: 33x to 368x), so the policy swaps
whenever the host pool has room. Re-measure on a GPU (PCIe copies against a fast prefill) before raising it.
"""


def should_swap(preemption_mode: str, num_blocks: int) -> bool:
    """Whether a sequence whose computed KV fills ``num_blocks`` blocks should be swapped
    (if the host pool has room) rather than recomputed. ``preemption_mode``: see EngineConfig."""
    if num_blocks == 0 or preemption_mode == "recompute":
        return False
    return preemption_mode == "swap" or num_blocks >= SWAP_MIN_BLOCKS


class Preemptor:
    """The Scheduler's preemption mechanics over the device and host pools, with their counts.

    A separate object so that the scheduler keeps only the policy; it calls this on a
    sequence it has taken out of its queues, and queues the sequence again by the status
    this leaves it in (SWAPPED, WAITING to be recomputed, or RUNNING once swapped in).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, swap_pool: SwapPool) -> None:
        self.config = config
        self.block_manager = block_manager
        self.swap_pool = swap_pool
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def preempt(self, seq: Sequence) -> list[tuple[int, int]]:
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

    def free_swapped(self, seq: Sequence) -> None:
        """Give back the host blocks of swapped ``seq``, which ends before it is swapped in."""
        self.swap_pool.free(seq.host_block_ids)
        seq.host_block_ids = []

    def _recompute(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, run the tokens again later."""
        logger.debug("preempting %s by recompute", seq.request_id)
        if seq.group is not None:  # a beam samples again once recomputed
            seq.group.candidates.pop(id(seq), None)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
