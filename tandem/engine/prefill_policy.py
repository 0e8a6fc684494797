"""Prefill packing: how the token budget a step has left after its decodes goes to prompts.

A step's budget is filled with prompt chunks of several sequences, in four passes (the
policy is explained in docs/scheduling.md, "Prefill packing"):

1. each prompt already being prefilled (running, or swapped back in) takes its next chunk,
   in the scheduling policy's order (fcfs: oldest first; waiting_queue.py), capped at
   ``long_prefill_token_threshold`` tokens (the Scheduler applies the cap: it is the only
   place a running sequence may preempt another);
2. the waiting prompts the policy lets in now, in queue order, each whole if it fits in
   what is left. While pass 1 capped a prompt, a waiting one that does not fit is passed
   over, so the shorter prompts behind it still start; otherwise the first that does not
   fit takes the rest as its first chunk (plain FCFS: shorter ones behind it wait for one
   chunk of it);
3. what is left goes back to the prompts pass 1 capped, in that order;
4. if budget is still left (every capped prompt finished), the first prompt pass 2 passed
   over takes it as its first chunk.

So a short prompt waits behind a long one for at most one chunk of it, a long prompt gets
at least ``min(threshold, budget left)`` tokens a step, and long prompts start one after
the other (the oldest gets everything the short ones leave). Prefix blocks a lookup loads from a
KV tier are paid for out of the budget (tier_load_cost.py).
"""

from __future__ import annotations

import time

from tandem.config import EngineConfig
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.tier_load_cost import TierLoadCost
from tandem.engine.waiting_queue import WaitingQueue
from tandem.kvcache.block_manager import BlockManager

Entry = tuple[Sequence, int]
"""A sequence scheduled this step and how many of its tokens run."""


class PrefillPacker:
    """Passes 2 to 4 above, over a scheduler's waiting queue and running list (the very
    objects: admitting moves a sequence from one to the other) and its block manager.
    A prompt's prefix blocks loaded from a KV tier take their cost out of the budget
    (tier_load_cost.py)."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, waiting: WaitingQueue,
                 running: list[Sequence]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting = waiting
        self.running = running
        self.load_cost = TierLoadCost(block_manager)

    def pack(self, entries: list[Entry], budget: int, admissible: list[Sequence]) -> int:
        """Fill ``budget`` (what the running and swapped-in sequences left) with prompt
        chunks: admit the ``admissible`` waiting sequences (in order, as far as they fit) and
        lengthen the chunks of capped entries; ``entries`` is updated in place. -> the
        budget left."""
        # Entries cut short of their last token: capped by pass 1 (or out of budget).
        capped = [i for i, (seq, n) in enumerate(entries) if n < seq.num_uncomputed_tokens]
        passed_over: Sequence | None = None
        if admissible:
            budget, passed_over = self._admit_waiting(entries, budget, admissible, pass_over_long=bool(capped))
        budget = self._refill(entries, capped, budget)
        if passed_over is not None and budget > 0:
            budget = self._admit_first_chunk(entries, passed_over, budget)
        return budget

    def _admit_waiting(self, entries: list[Entry], budget: int, admissible: list[Sequence],
                       pass_over_long: bool) -> tuple[int, Sequence | None]:
        """Pass 2. -> the budget left, and the first prompt passed over (or None)."""
        bm, config = self.block_manager, self.config
        passed_over: Sequence | None = None
        for seq in admissible:
            if budget <= 0 or len(self.running) >= config.max_num_seqs:
                break
            cached_block_ids, budget = self._cached_prefix(seq, budget)
            if cached_block_ids is None:
                break  # NOTE: FCFS: its prefix loads on next step, before any prompt behind it starts.
            remaining = seq.num_tokens - len(cached_block_ids) * bm.block_size
            n = min(remaining, budget)
            if n < remaining:
                if pass_over_long:
                    if passed_over is None:
                        passed_over = seq
                    continue
                if not config.enable_chunked_prefill:
                    break  # NOTE: FCFS: a prompt that must run whole keeps the ones behind it waiting.
            # NOTE: out of blocks, nothing newer starts either: a short prompt never takes
            # the blocks an older one waits for.
            if not bm.can_allocate(seq, self._reserved(n, remaining), cached_block_ids):
                break
            self._admit(entries, seq, n, cached_block_ids, self._reserved(n, remaining))
            budget -= n
        return budget, passed_over

    def _refill(self, entries: list[Entry], capped: list[int], budget: int) -> int:
        """Pass 3: give the capped entries, oldest first, what is left, as far as free
        blocks allow (a refill never preempts: the capped chunk already made progress)."""
        bm = self.block_manager
        for i in capped:
            if budget <= 0:
                break
            seq, n = entries[i]
            # NOTE: the capped chunk's allocation already copied any shared block it writes,
            # so every further block is a fresh one.
            room = (len(seq.block_ids) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
            extra = min(seq.num_uncomputed_tokens - n, budget, room - n)
            if extra <= 0:
                continue
            bm.allocate(seq, n + extra)
            entries[i] = (seq, n + extra)
            budget -= extra
        return budget

    def _admit_first_chunk(self, entries: list[Entry], seq: Sequence, budget: int) -> int:
        """Pass 4: start the prompt pass 2 passed over with the rest of the budget."""
        bm = self.block_manager
        if len(self.running) >= self.config.max_num_seqs:
            return budget
        # Found again: blocks taken since pass 2 may have evicted part of the cached prefix.
        cached_block_ids, budget = self._cached_prefix(seq, budget)
        if cached_block_ids is None:
            return budget
        remaining = seq.num_tokens - len(cached_block_ids) * bm.block_size
        n = min(remaining, budget)
        if not bm.can_allocate(seq, self._reserved(n, remaining), cached_block_ids):
            return budget
        self._admit(entries, seq, n, cached_block_ids, self._reserved(n, remaining))
        return budget - n

    def _cached_prefix(self, seq: Sequence, budget: int) -> tuple[list[int] | None, int]:
        """``seq``'s cached prefix, loading from the tiers no more than ``budget`` pays for.
        -> its block ids (None: more of it is still to load, or the loads took the whole
        budget; the blocks loaded stay cached for the next step), and the budget left."""
        lookup = self.block_manager.lookup_prefix(seq, self.load_cost.max_loads(budget))
        budget -= self.load_cost.charge(lookup.num_loaded)
        if not lookup.complete or budget <= 0:
            return None, budget
        return lookup.block_ids, budget

    def _reserved(self, n: int, remaining: int) -> int:
        """The tokens a prompt admitted with its first `n` of `remaining` takes blocks for:
        all of them with reserve_whole_prompts (its later chunks then never preempt)."""
        return remaining if self.config.reserve_whole_prompts else n

    def _admit(self, entries: list[Entry], seq: Sequence, n: int, cached_block_ids: list[int], reserved: int
               ) -> None:
        """Move waiting ``seq`` to the running set with its first ``n`` tokens scheduled and
        blocks for ``reserved`` (>= n) of them."""
        self.waiting.remove(seq)
        self.block_manager.allocate(seq, reserved, cached_block_ids)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        entries.append((seq, n))
