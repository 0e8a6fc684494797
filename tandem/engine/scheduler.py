"""Continuous batching: which sequences run this step, and how many tokens each.

Policy only: the order of service (fcfs or priority: the WaitingQueue, waiting_queue.py),
the token budget, who gives way (the Preemptor swaps or drops their KV), how prompt chunks
share the budget (the PrefillPacker, prefill_policy.py).
:meth:`Scheduler.update` is the one place where a sequence's state moves forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from tandem.config import EngineConfig
from tandem.decoding.beam_stepper import BeamStepper
from tandem.decoding.speculation import Speculator
from tandem.engine.preemption import Preemptor
from tandem.engine.prefill_policy import PrefillPacker
from tandem.engine.sampler import StepOutput, TargetSample
from tandem.engine.scheduled_batch import ScheduledBatch
from tandem.engine.sequence import Sequence, SequenceStatus, SequenceUpdate
from tandem.engine.waiting_queue import WaitingQueue, make_waiting_queue
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.swap_pool import SwapPool
from tandem.logprobs import TopLogprobs

logger = logging.getLogger(__name__)


class Scheduler:
    """The waiting, running and swapped-out sequences of one engine, and each step's batch."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: WaitingQueue = make_waiting_queue(config.scheduling_policy)
        """Waiting sequences, in admission order; also the policy (its rank orders the others)."""
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        """Swapped-out sequences, in the policy's order (fcfs: oldest first)."""
        self.preemptor = Preemptor(config, block_manager, SwapPool(config.num_swap_blocks, config.num_kv_blocks))
        self.speculator = Speculator(config, block_manager)
        self.beam_stepper = BeamStepper(self)
        self.prefill_packer = PrefillPacker(config, block_manager, self.waiting, self.running)
        self._scheduled_at = time.monotonic()
        """When the last batch was scheduled (so update() times the step)."""

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def reserved_prefix(self, seq: Sequence) -> list[int]:
        """The cached prefix of ``seq``, whose KV is computed elsewhere, reserved between steps
        (LLMEngine.reserve_prefilled): it loads from the tiers no more than a step's budget
        pays for (tier_load_cost.py); the blocks past what it loads arrive with the rest."""
        cost = self.prefill_packer.load_cost
        lookup = self.block_manager.lookup_prefix(seq, cost.max_loads_between_steps(self.config.max_num_batched_tokens))
        cost.owe(lookup.num_loaded)
        return lookup.block_ids

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        # NOTE: a prefill chunk is capped at first so that waiting prompts that fit get in
        # behind it; PrefillPacker gives it the budget they leave (prefill_policy.py).
        cap = self.config.long_prefill_token_threshold
        entries: list[tuple[Sequence, int]] = []
        draft_token_ids: dict[int, list[int]] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        preempted = False

        # Running sequences first, in the policy's step order (decodes first within it); the
        # last unscheduled one in the policy's rank (fcfs: the newest) gives way when blocks
        # run out.
        self.running.sort(key=self.waiting.rank)
        scheduled: set[int] = set()
        for seq in self.waiting.step_order(self.running):
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens == 0:
                continue  # preempted for an earlier one, or a beam waiting for the others
            drafts = self.speculator.propose(seq, budget)
            n = min(seq.num_uncomputed_tokens, budget, cap) + len(drafts)
            while not bm.can_allocate(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                swap_out += self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                # It was the last left in rank: only prompts being chunked that rank before it
                # may follow it, and they may still fit in what it gave back (else the batch
                # could be empty).
                continue
            copies += bm.allocate(seq, n)
            entries.append((seq, n))
            draft_token_ids[id(seq)] = drafts
            scheduled.add(id(seq))
            budget -= n

        # Then swapped sequences, in rank order, unless we just preempted. NOTE: host blocks
        # freed here are only taken again by a later step's swap-out, whose copies run later.
        while self.swapped and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget, cap)
            if not self.preemptor.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            swap_in += self.preemptor.swap_in(seq, n)
            self.running.append(seq)
            entries.append((seq, n))
            budget -= n

        # Then waiting (new or recompute-preempted) prompts, as far as the policy lets them
        # pass the swapped ones still waiting to resume (fcfs: not at all), unless we just
        # preempted; what is left goes back to the capped chunks.
        admissible = [] if preempted else self.waiting.admissible(self.swapped[0] if self.swapped else None)
        self.prefill_packer.pack(entries, max(budget - self.prefill_packer.load_cost.take_owed(), 0), admissible)

        entries.sort(key=lambda e: e[1] != 1)  # stable: decodes first, then prefill chunks
        self._scheduled_at = time.monotonic()
        return ScheduledBatch([s for s, _ in entries], [n for _, n in entries], swap_out, swap_in,
                              [draft_token_ids.get(id(s), []) for s, _ in entries], copies)

    def _preempt(self, victim: Sequence) -> list[tuple[int, int]]:
        """Take running ``victim``'s blocks back; it waits where the policy puts it (swapped:
        by rank; recompute: WaitingQueue.requeue). -> the blocks to swap out."""
        self.running.remove(victim)
        swap_out = self.preemptor.preempt(victim)
        if victim.status == SequenceStatus.SWAPPED:
            bisect.insort(self.swapped, victim, key=self.waiting.rank)
        else:
            self.waiting.requeue(victim)
        return swap_out

    def update(self, batch: ScheduledBatch, sampled: StepOutput) -> list[SequenceUpdate]:
        """Advance every scheduled sequence past the step that just ran."""
        # The step's time since it was scheduled: what a token costs, against a tier load.
        self.prefill_packer.load_cost.observe_step(batch.num_tokens, time.monotonic() - self._scheduled_at)
        updates: list[SequenceUpdate] = []
        num_sampled = 0
        for i, seq in enumerate(batch.seqs):
            num_targets = len(batch.sample_targets(i))
            outputs = [sampled.target(j) for j in range(num_sampled, num_sampled + num_targets)]
            num_sampled += num_targets
            if seq.status.is_finished:  # aborted while its step ran: nothing to advance
                continue
            # NOTE: drafts count as computed only once accepted (append_tokens).
            seq.num_computed_tokens += batch.num_new_tokens[i] - batch.num_drafts(i)
            self.block_manager.cache_full_blocks(seq)
            if outputs:  # else a prefill chunk short of the prompt's end
                updates += self.advance(seq, outputs, batch.num_drafts(i))
        return updates

    def advance(self, seq: Sequence, outputs: list[TargetSample], num_drafts: int = 0) -> list[SequenceUpdate]:
        """Move ``seq``, computed up to its last token, past what was sampled from its
        logits: per sample target (see ScheduledBatch.sample_targets), its tokens and
        log-probabilities, or with beam search its top candidates."""
        group = seq.group
        if group is not None and group.beam is not None:
            return self.beam_stepper.advance(seq, (outputs[0].token_ids, outputs[0].logprobs))
        forks = group.take_forks() if group is not None and seq is group.root else []
        for fork in forks:
            self.fork(seq, fork)
        return [self.append_tokens(s, sample, num_drafts) for s, sample in zip([seq, *forks], outputs)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` from where ``parent`` is, on its blocks (copy-on-write)."""
        child.take_progress(parent)
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def retire(self, seq: Sequence) -> None:
        """Drop a running beam that no continuation extends (its blocks, unless kept)."""
        self.running.remove(seq)
        if not seq.keep_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED

    def append_tokens(self, seq: Sequence, sample: TargetSample, num_drafts: int) -> SequenceUpdate:
        """Add a step's tokens in order: the accepted drafts (whose KV the step computed),
        then the target's own token; the tokens after one that ends the sequence are dropped."""
        parts: list[SequenceUpdate] = []
        token_ids = sample.token_ids
        for j, (token_id, logprob) in enumerate(zip(token_ids, sample.logprobs)):
            top = sample.top_logprobs[j] if sample.top_logprobs else None
            parts.append(self.append_token(seq, token_id, logprob, top))
            if seq.status.is_finished:
                break
            if j < len(token_ids) - 1:
                seq.num_computed_tokens += 1  # an accepted draft: its KV is in the cache
        if num_drafts:
            self.speculator.settle(seq, num_drafts, len(token_ids) - 1)
        return SequenceUpdate(seq, [t for u in parts for t in u.new_token_ids], "".join(u.new_text for u in parts),
                              [lp for u in parts for lp in u.new_logprobs],
                              [top for u in parts for top in u.new_top_logprobs])

    def append_token(self, seq: Sequence, token_id: int, logprob: float,
                     top_logprobs: TopLogprobs | None = None) -> SequenceUpdate:
        """Add a sampled token to a sequence whose KV is computed up to it; stop if it ends."""
        status = self.end_of(seq, token_id)
        if seq.grammar is not None:
            # The mask let only the grammar's tokens through, so a token it refuses all the same
            # (EOS included) means the processors had masked every allowed one: the token is
            # dropped and the output, a valid prefix, ends there; a complete grammar ends it too.
            if not seq.grammar.accept_token(token_id):
                logger.warning("request %s: the logits processors left no token its grammar allows after %d "
                               "output tokens: ending it (abort)", seq.request_id, seq.num_output_tokens)
                self._finish(seq, SequenceStatus.FINISHED_UNSATISFIABLE)
                new_text = seq.detokenizer.flush() if seq.detokenizer is not None else ""
                return SequenceUpdate(seq, [], new_text, [], [])
            if status is None and seq.grammar.is_terminated:
                status = SequenceStatus.FINISHED_STOPPED
        seq.token_ids.append(token_id)
        seq.output_logprobs.append(logprob)
        if top_logprobs is not None:
            seq.output_top_logprobs.append(top_logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        new_text = ""
        # As vLLM: an ending EOS never shows in the text (even with skip_special_tokens off),
        # unless include_stop_str_in_output.
        ending_eos = (status is SequenceStatus.FINISHED_STOPPED and token_id in self.config.model.eos_token_ids
                      and not seq.params.ignore_eos and not seq.params.include_stop_str_in_output)
        if seq.detokenizer is not None:
            delta = seq.detokenizer.append(token_id) if not ending_eos else None
            new_text = "" if delta is None else delta.text
            if delta is not None and delta.stopped:
                status = SequenceStatus.FINISHED_STOPPED
            elif status is not None:
                new_text += seq.detokenizer.flush()
        if status is not None:
            self._finish(seq, status)
        return SequenceUpdate(seq, [token_id], new_text, [logprob], [] if top_logprobs is None else [top_logprobs])

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose prompt KV is already in its blocks (sent by a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever its sequences are; their blocks return to the pool.
        -> the first of them found, or None."""
        found = [s for s in (*self.waiting, *self.running, *self.swapped) if s.request_id == request_id]
        for seq in found:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not found:
            return None
        group = found[0].group
        if group is not None:
            for seq in group.take_forks():
                seq.status = SequenceStatus.FINISHED_ABORTED
        return found[0]

    def end_of(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """Why appending ``token_id`` to ``seq`` ends it (stop strings aside), or None."""
        params = seq.params
        if not params.ignore_eos and token_id in self.config.model.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens + 1 >= params.max_tokens or seq.num_tokens + 1 >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.preemptor.free_swapped(seq)
        if not seq.keep_blocks:
            self.block_manager.free(seq)
        seq.status = status
