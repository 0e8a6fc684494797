"""Continuous batching: which sequences run this step, and how many tokens each.

Policy only (FCFS, token budget, preemption by recompute); the block manager keeps the
books. :meth:`Scheduler.update` is the one place where a sequence's state moves forward.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from tandem.block_manager import BlockManager
from tandem.config import EngineConfig
from tandem.sampler import SamplerOutput
from tandem.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]``, from its first
    uncomputed token on. Single-token entries (decodes) come first."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether entry i reaches the end of its tokens, so a new token is sampled."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step added to a sequence: a token, its text, maybe the end."""

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
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
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
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.allocate(seq, n)
            entries.append((seq, n))
            scheduled.add(id(seq))
            budget -= n

        # Then new (or preempted) sequences in arrival order, unless we just preempted.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
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
        return ScheduledBatch([s for s, _ in entries], [n for _, n in entries])

    def update(self, batch: ScheduledBatch, sampled: SamplerOutput) -> list[SequenceUpdate]:
        """Advance every scheduled sequence past the step that just ran."""
        updates: list[SequenceUpdate] = []
        num_sampled = 0
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            if seq.status.is_finished:  # aborted while its step ran: nothing to advance
                num_sampled += samples
                continue
            seq.num_computed_tokens += batch.num_new_tokens[i]
            self.block_manager.cache_full_blocks(seq)
            if not samples:
                continue  # a prefill chunk short of the prompt's end
            updates.append(self.append_token(seq, sampled.token_ids[num_sampled], sampled.logprobs[num_sampled]))
            num_sampled += 1
        return updates

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
        for seq in (*self.waiting, *self.running):
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
        if not seq.keep_blocks:
            self.block_manager.free(seq)
        seq.status = status

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, run the tokens again later."""
        logger.debug("preempting %s", seq.request_id)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
