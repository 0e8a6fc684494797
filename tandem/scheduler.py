"""Continuous batching: which sequences run this step, and how many tokens each.

Policy only (FCFS, token budget, preemption by swap or recompute); the block manager and
the swap pool keep the books, the model runner copies swapped blocks.
:meth:`Scheduler.update` is the one place where a sequence's state moves forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.block_manager import BlockManager
from tandem.config import EngineConfig
from tandem.preemption import should_swap
from tandem.sampler import StepOutput
from tandem.sequence import Sequence, SequenceStatus
from tandem.speculation import Speculator
from tandem.swap_pool import SwapPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]``, from its first
    uncomputed token on, then its ``draft_token_ids[i]`` (a speculative decode: the drafts
    count in ``num_new_tokens[i]``). Single-token entries (decodes) come first.

    Before the step's forward, the runner copies ``swap_out`` then ``swap_in``: the device
    blocks a swapped-out sequence gave up may be written by this very step.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block id, host block id) pairs to copy device -> host."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block id, device block id) pairs to copy host -> device."""
    draft_token_ids: list[list[int]] = field(default_factory=list)
    """Per entry (or empty: no entry has drafts)."""

    def num_drafts(self, i: int) -> int:
        return len(self.draft_token_ids[i]) if self.draft_token_ids else 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """No sequence runs (there may still be blocks to swap)."""
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether entry i reaches the end of its tokens, so a new token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - self.num_drafts(i) == seq.num_tokens


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step added to a sequence: a token (or several, with speculation), its text, maybe the end."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        """Swapped-out sequences, oldest first."""
        self.swap_pool = SwapPool(config.num_swap_blocks, config.num_kv_blocks)
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.speculator = Speculator(config, block_manager)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        draft_token_ids: dict[int, list[int]] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted = False

        # Running sequences first, oldest first; the newest unscheduled one gives way when
        # blocks run out. NOTE: decodes before prefill chunks, so that a flood of long prompts
        # never starves a running decode (each needs one token of the budget).
        self.running.sort(key=lambda s: s.arrival_index)
        decodes_first = sorted(self.running, key=lambda s: s.num_uncomputed_tokens != 1)
        scheduled: set[int] = set()
        for seq in decodes_first:
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an earlier one
            drafts = self.speculator.propose(seq, budget)
            n = min(seq.num_uncomputed_tokens, budget) + len(drafts)
            while not bm.can_allocate(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.running.remove(victim)
                swap_out += self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.allocate(seq, n)
            entries.append((seq, n))
            draft_token_ids[id(seq)] = drafts
            scheduled.add(id(seq))
            budget -= n

        # Then swapped sequences, oldest first, unless we just preempted. NOTE: host blocks
        # freed here are only taken again by a later step's swap-out, whose copies run later.
        while self.swapped and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            swap_in += self.swap_in(seq, n)
            self.running.append(seq)
            entries.append((seq, n))
            budget -= n

        # Then new (or recompute-preempted) sequences in arrival order, once no swapped one
        # waits to resume, unless we just preempted.
        while (self.waiting and not self.swapped and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            cached_block_ids = bm.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(cached_block_ids) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, n, cached_block_ids):
                break
            self.waiting.popleft()
            bm.allocate(seq, n, cached_block_ids)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append((seq, n))
            budget -= n

        entries.sort(key=lambda e: e[1] != 1)  # stable: decodes first, then prefill chunks
        return ScheduledBatch([s for s, _ in entries], [n for _, n in entries], swap_out, swap_in,
                              [draft_token_ids.get(id(s), []) for s, _ in entries])

    def update(self, batch: ScheduledBatch, sampled: StepOutput) -> list[SequenceUpdate]:
        """Advance every scheduled sequence past the step that just ran."""
        updates: list[SequenceUpdate] = []
        num_sampled = 0
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            if seq.status.is_finished:  # aborted while its step ran: nothing to advance
                num_sampled += samples
                continue
            # NOTE: drafts count as computed only once accepted (append_tokens).
            seq.num_computed_tokens += batch.num_new_tokens[i] - batch.num_drafts(i)
            self.block_manager.cache_full_blocks(seq)
            if not samples:
                continue  # a prefill chunk short of the prompt's end
            updates.append(self.append_tokens(seq, sampled.token_ids[num_sampled], sampled.logprobs[num_sampled],
                                              batch.num_drafts(i)))
            num_sampled += 1
        return updates

    def append_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list[float],
                      num_drafts: int) -> SequenceUpdate:
        """Add a step's tokens in order: the accepted drafts (whose KV the step computed),
        then the target's own token; the tokens after one that ends the sequence are dropped."""
        parts: list[SequenceUpdate] = []
        for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            parts.append(self.append_token(seq, token_id, logprob))
            if seq.status.is_finished:
                break
            if j < len(token_ids) - 1:
                seq.num_computed_tokens += 1  # an accepted draft: its KV is in the cache
        if num_drafts:
            self.speculator.settle(seq, num_drafts, len(token_ids) - 1)
        return SequenceUpdate(seq, [t for u in parts for t in u.new_token_ids], "".join(u.new_text for u in parts),
                              [lp for u in parts for lp in u.new_logprobs])

    def append_token(self, seq: Sequence, token_id: int, logprob: float) -> SequenceUpdate:
        """Add a sampled token to a sequence whose KV is computed up to it; stop if it ends."""
        seq.token_ids.append(token_id)
        seq.output_logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        new_text = ""
        status = self._stop_status(seq, token_id)
        if seq.detokenizer is not None:
            delta = seq.detokenizer.append(token_id)
            new_text = delta.text
            if delta.stopped:
                status = SequenceStatus.FINISHED_STOPPED
            elif status is not None:
                new_text += seq.detokenizer.flush()
        if status is not None:
            self._finish(seq, status)
        return SequenceUpdate(seq, [token_id], new_text, [logprob])

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose prompt KV is already in its blocks (sent by a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its blocks return to the pool."""
        for seq in (*self.waiting, *self.running, *self.swapped):
            if seq.request_id == request_id:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                return seq
        return None

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.config.model.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_pool.free(seq.host_block_ids)
            seq.host_block_ids = []
        if not seq.keep_blocks:
            self.block_manager.free(seq)
        seq.status = status

    def _preempt(self, seq: Sequence) -> list[tuple[int, int]]:
        """Swap ``seq`` out or drop its KV, as the policy says. -> the blocks to swap out."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        num_blocks = self.block_manager.num_blocks_for(seq.num_computed_tokens)
        if should_swap(self.config.preemption_mode, num_blocks) and self.can_swap_out(seq):
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
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
