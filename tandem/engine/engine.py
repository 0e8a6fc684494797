"""The engine core both pools run: admission, the step loop, abort."""

from __future__ import annotations

import functools
import itertools
import logging

import torch

from tandem.config import EngineConfig
from tandem.decoding import beam_search
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.grammars import Grammars
from tandem.engine.hooks import PrefillHooks
from tandem.engine.kv_tiers import tiers_for
from tandem.engine.model_runner import ModelRunner
from tandem.engine.observer import EngineObserver
from tandem.engine.sampler import TargetSample
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceGroup, SequenceStatus, SequenceUpdate, check_resumable
from tandem.engine.snapshots import EngineCounters, EngineInventory, EngineLoad
from tandem.engine.step_threads import StepThreads
from tandem.kvcache.block_manager import BlockManager
from tandem.kvcache.capacity import KVCapacity
from tandem.model.llama import LlamaModel
from tandem.outputs import FirstSample, RequestDelta
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model over one paged KV pool, stepped by the caller.

    ``step()`` schedules, runs the model and moves every scheduled request forward. A
    worker reads the engine through its methods (load, inventory, counters, get_sequence),
    never through the scheduler's queues or the block manager.
    """

    def __init__(self, config: EngineConfig, model: LlamaModel, tokenizer=None, *,
                 runner: ModelRunner | None = None, hooks: PrefillHooks | None = None,
                 observer: EngineObserver | None = None, grammars: Grammars | None = None,
                 step_threads: StepThreads | None = None) -> None:
        """runner: runs ``model`` (default: a ModelRunner over it; a tensor-parallel one is given).
        hooks: what runs inside every step (a prefill worker's KV sends).
        observer: told of every step, first token and finish (a worker's metrics).
        grammars: structured outputs' compiler (default: over ``tokenizer``; a prefill worker,
        which emits no text and has no tokenizer here, gives one over the model's).
        step_threads: the torch threads each step runs on, by its size (None: as the process
        has them)."""
        self.config = config
        if config.seed is not None:  # NOTE: the process's generator: unseeded sampling draws from it
            torch.manual_seed(config.seed)
        self.tokenizer = tokenizer
        self.grammars = (grammars if grammars is not None
                         else Grammars(tokenizer, config.model.vocab_size, config.model.eos_token_ids))
        self.observer = observer
        self.hooks = hooks
        self.step_threads = step_threads
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = runner if runner is not None else ModelRunner(config, model)
        self.block_manager.tier = tiers_for(config, model, self.runner)
        self.sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        logger.info("KV pool: %s", KVCapacity.of_engine_config(config).describe())

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    keep_blocks: bool = False, priority: int = 0, num_resumed_tokens: int = 0) -> Sequence:
        """Queue a request; raises ValueError at once when it could never run.
        keep_blocks: its blocks outlive it until :meth:`release_blocks` (a prefill worker's
        KV is still being read out after the request ends).
        priority: vLLM's; under the priority scheduling policy lower is served first (ties in
        arrival order); under fcfs only 0 is taken (ValueError otherwise).
        num_resumed_tokens: the last this many of prompt_token_ids are the output of a request
        resumed here (a migrated one, WorkerRequest.num_resumed_tokens): computed with the
        prompt, counted, penalized, constrained and detokenized as output."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority, num_resumed_tokens)
        seq.keep_blocks = keep_blocks
        self.scheduler.add(seq)
        return seq

    def may_add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> bool:
        """Whether the pool has room now for this prompt (beyond its cached prefix) and its
        first token, after the prompts already waiting (:meth:`add_request` queues it anyway)."""
        self.check_prompt(prompt_token_ids)
        bm = self.block_manager
        probe = Sequence("", prompt_token_ids, params, -1, None)
        num_cached = len(bm.find_cached_prefix(probe, restore=False)) * bm.block_size
        num_waiting = sum(bm.num_blocks_for(s.num_tokens - s.num_computed_tokens) for s in self.scheduler.waiting)
        return bm.num_blocks_for(len(prompt_token_ids) - num_cached + 1) + num_waiting <= bm.num_free_blocks

    def release_blocks(self, seq: Sequence) -> None:
        """Free the blocks that ``seq``, added with keep_blocks, kept past its end."""
        # NOTE: only once it has ended: until then its blocks are the scheduler's.
        self.block_manager.free(seq)

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The request's (first) sequence, or None when the engine does not hold it."""
        return self.sequences.get(request_id)

    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, num_resumed_tokens: int = 0) -> list[int] | None:
        """Hold blocks for a prompt whose KV another worker computes. -> their ids, or None
        when the pool cannot hold it now. The leading blocks may be this pool's own cached
        prefix (shared, their KV already here): the sequence's num_cached_prompt_tokens
        counts their tokens, and only the rest must arrive. The request waits outside the
        scheduler until :meth:`start_prefilled`. priority, num_resumed_tokens: as :meth:`add_request`'s."""
        self.check_prompt(prompt_token_ids)  # before the room check: a prompt that never fits is a ValueError
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority, num_resumed_tokens)
        cached_block_ids = self.scheduler.reserved_prefix(seq)  # (tier loads within a step's budget)
        num_cached_tokens = len(cached_block_ids) * self.block_manager.block_size
        # Room for the prompt and the first decode step, beyond what running sequences hold.
        if not self.block_manager.can_allocate(seq, len(prompt_token_ids) - num_cached_tokens + 1, cached_block_ids):
            del self.sequences[request_id]
            return None
        self.block_manager.allocate(seq, len(prompt_token_ids) - num_cached_tokens, cached_block_ids)
        seq.num_cached_prompt_tokens = num_cached_tokens
        return list(seq.block_ids)

    @staticmethod
    def may_accept_first_sample(seq: Sequence) -> bool:
        """Whether a reserved ``seq`` can take its first sample before its KV has arrived
        (:meth:`accept_first_sample`): a single completion (n > 1 forks the prompt's
        blocks, beam search its candidates, both only once the KV is in them)."""
        return seq.group is None and seq.num_output_tokens == seq.num_resumed_tokens

    def accept_first_sample(self, request_id: str, sample: FirstSample) -> list[RequestDelta]:
        """The first sample of a reserved request, drawn by a prefill worker, while its KV is
        still arriving: the token goes out now (its delta), and the request joins the
        running batch at :meth:`start_prefilled`. A sample that ends the request finishes
        it here; its blocks then wait for :meth:`release_blocks` (see may_accept_first_sample)."""
        seq = self.sequences[request_id]
        # NOTE: the KV may still be landing in these blocks: they stay until the transfer
        # has ended, whatever the sample does to the sequence.
        seq.keep_blocks = True
        return self._deltas(self.scheduler.advance(seq, [TargetSample(sample.token_ids, sample.logprobs,
                                                                      sample.top_logprobs)]))

    def start_prefilled(self, request_id: str, sample: FirstSample | None = None) -> list[RequestDelta]:
        """The prompt KV of a reserved request has arrived: it joins the running batch with
        its first sample, drawn elsewhere (unless that sample already ends it), or with the
        one :meth:`accept_first_sample` took before (sample None)."""
        seq = self.sequences[request_id]
        # NOTE: not num_tokens: the first sample, taken before the KV came, is still to compute
        seq.num_computed_tokens = seq.num_prompt_tokens + seq.num_resumed_tokens  # (what the KV holds)
        self.block_manager.cache_full_blocks(seq)
        if sample is None:
            seq.keep_blocks = False
            self.scheduler.add_running(seq)
            return []
        self.scheduler.add_running(seq)
        outputs = ([TargetSample(sample.token_ids, sample.logprobs, [])] if seq.params.use_beam_search
                   else [TargetSample([t], [lp], sample.top_logprobs[i:i + 1])
                         for i, (t, lp) in enumerate(zip(sample.token_ids, sample.logprobs))])
        return self._deltas(self.scheduler.advance(seq, outputs))

    @staticmethod
    def first_sample(seq: Sequence) -> FirstSample | None:
        """What the prompt's first sample drew for ``seq``'s request (for a decode worker's
        start_prefilled), or None before it has. Call right after the step that drew it:
        (A seeded completion needs no state handed on: its draws are a function of its seed
        and the token's position, device_random.py.)"""
        if seq.params.use_beam_search:
            assert seq.group is not None  # add_request gives every beam search its group
            candidates = seq.group.first_candidates
            return None if candidates is None else FirstSample(*candidates)
        first = seq.num_resumed_tokens  # (the resumed tokens have no log-probabilities here)
        if seq.num_output_tokens <= first:
            return None
        targets = LLMEngine._first_sample_targets(seq)
        return FirstSample([s.output_token_ids[first] for s in targets], [s.output_logprobs[0] for s in targets],
                           [s.output_top_logprobs[0] for s in targets if s.output_top_logprobs])

    @staticmethod
    def _first_sample_targets(seq: Sequence) -> list[Sequence]:
        """The sequences a prompt's first sample draws for (FirstSample's order)."""
        if seq.group is None or seq.params.use_beam_search:
            return [seq]
        return seq.group.completions

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: int = 0, num_resumed_tokens: int = 0) -> Sequence:
        self.check_request(request_id, prompt_token_ids, priority)
        check_resumable(params, len(prompt_token_ids), num_resumed_tokens)
        new_detokenizer = functools.partial(self._new_detokenizer, params)
        arrival_index = next(self._arrivals)
        num_prompt_tokens = len(prompt_token_ids) - num_resumed_tokens
        seq = Sequence(request_id, prompt_token_ids[:num_prompt_tokens], params, arrival_index, new_detokenizer(),
                       grammar=self.grammars.matcher(params))
        seq.resume(prompt_token_ids[num_prompt_tokens:])
        seq.priority = priority  # (its forks and beams take it from it: Sequence.take_progress)
        if params.use_beam_search:
            num_candidates = beam_search.num_candidates(params.beam_width, len(self.config.model.eos_token_ids))
            SequenceGroup(seq, [], beam_search.BeamSearch(params.beam_width, params.length_penalty, num_candidates),
                          new_detokenizer)
        elif params.n > 1:
            forks = [Sequence(request_id, prompt_token_ids, params, arrival_index, new_detokenizer(), i,
                              self.grammars.matcher(params)) for i in range(1, params.n)]
            SequenceGroup(seq, forks, None, new_detokenizer)
        self.sequences[request_id] = seq
        return seq

    def _new_detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        return None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output)

    def check_request(self, request_id: str, prompt_token_ids: list[int], priority: int = 0) -> None:
        """Raise ValueError if :meth:`add_request` would refuse this request (so that a caller
        can refuse it before doing anything else for it)."""
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.scheduler.waiting.check_priority(priority)
        self.check_prompt(prompt_token_ids)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError if this prompt could never run on this engine."""
        cfg = self.config
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise ValueError("prompt is empty: it must have at least one token")
        vocab = cfg.model.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        # One more slot for the first generated token.
        num_blocks = -(-(num_tokens + 1) // cfg.block_size)
        if num_blocks > cfg.num_kv_blocks:
            raise ValueError(
                f"prompt of {num_tokens} tokens could never fit in the KV pool: it needs "
                f"{num_blocks} blocks of {cfg.block_size} tokens and the pool has {cfg.num_kv_blocks}"
            )
        if num_tokens >= cfg.max_model_len:
            raise ValueError(
                f"prompt of {num_tokens} tokens is too long: max_model_len is {cfg.max_model_len} "
                "(prompt and output together)"
            )

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """End a request wherever it is. -> its last delta (finish_reason ABORT), or None
        when it is not here."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            seq = self.sequences.get(request_id)
            if seq is None:
                return None
            # Reserved for a prefill elsewhere, not yet started.
            if not seq.keep_blocks:
                self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        self._remove(seq)
        return self._delta(SequenceUpdate(seq, [], "", []), num_unfinished=0)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def load(self) -> EngineLoad:
        """How busy it is now: what a router weighs when it picks a worker."""
        sched, bm = self.scheduler, self.block_manager
        return EngineLoad(num_requests=len(self.sequences), num_waiting=len(sched.waiting),
                          num_running=len(sched.running),
                          num_queued_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
                          num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks)

    def inventory(self) -> EngineInventory:
        """What it holds for requests now (at rest nothing: a leak check)."""
        sched, bm = self.scheduler, self.block_manager
        scheduled = {s.request_id for s in (*sched.waiting, *sched.running, *sched.swapped)}
        return EngineInventory(
            num_requests=len(self.sequences), num_waiting=len(sched.waiting), num_running=len(sched.running),
            num_reserved=sum(1 for rid in self.sequences if rid not in scheduled),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_referenced_blocks=sum(1 for c in bm.ref_counts if c != 0),
            num_swapped_blocks=sched.preemptor.swap_pool.num_used_blocks)

    def counters(self) -> EngineCounters:
        """What it has done since it started (metrics' counters)."""
        preemptor, speculator = self.scheduler.preemptor, self.scheduler.speculator
        return EngineCounters(preemptor.num_preemptions, preemptor.num_swapped_out_blocks,
                              preemptor.num_swapped_in_blocks, speculator.num_draft_tokens,
                              speculator.num_accepted_tokens)

    def step(self) -> list[RequestDelta]:
        """Run one step. -> the deltas of the requests it moved forward."""
        batch = self.scheduler.schedule()
        self.runner.swap(batch)  # even with no sequence to run: the swap-outs must not wait
        if batch.is_empty:
            return []
        if self.observer is not None:
            self.observer.on_step(batch)
        if self.step_threads is not None:
            self.step_threads.apply(batch.num_tokens)
        hooks = self.hooks
        if hooks is None:
            sampled = self.runner.run(batch)
        else:
            sampled = self.runner.run(batch, functools.partial(hooks.on_layer_stored, batch),
                                      None if hooks.send_plan is None else hooks.send_plan(batch))
        deltas = self._deltas(self.scheduler.update(batch, sampled))
        if hooks is not None:
            for d in deltas:
                hooks.on_delta(d)
        return deltas

    def _deltas(self, updates: list[SequenceUpdate]) -> list[RequestDelta]:
        deltas = []
        for u in updates:
            delta = self._delta(u, self._count_open(u.seq))
            deltas.append(delta)
            # A speculative step may add the first token and more after it.
            if self.observer is not None and u.seq.index == 0 and u.seq.num_output_tokens == len(u.new_token_ids):
                self.observer.on_first_token(u.seq)
            if delta.request_finished:
                self._remove(u.seq)
        return deltas

    def _remove(self, seq: Sequence) -> None:
        """A finished sequence leaves the engine (its blocks are already freed, or kept)."""
        del self.sequences[seq.request_id]
        if self.observer is not None:
            self.observer.on_finished(seq)

    @staticmethod
    def _count_open(seq: Sequence) -> int:
        """-> the completions of ``seq``'s request still going, counting this update of
        ``seq`` as gone out (each completion's last update comes once)."""
        if seq.group is None:
            return 0 if seq.status.is_finished else 1
        seq.group.num_open -= seq.status.is_finished
        return seq.group.num_open

    @staticmethod
    def _delta(update: SequenceUpdate, num_unfinished: int) -> RequestDelta:
        seq, group, params = update.seq, update.seq.group, update.seq.params
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=update.new_token_ids,
            new_text=update.new_text,
            new_logprobs=update.new_logprobs if params.logprobs is not None else None,
            new_top_logprobs=update.new_top_logprobs if params.top_logprobs else None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens if group is None else group.num_output_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            index=seq.index,
            num_unfinished=num_unfinished,
        )
