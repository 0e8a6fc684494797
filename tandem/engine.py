"""The engine core both pools run: admission, the step loop, abort."""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Callable

import torch

from tandem.block_manager import BlockManager
from tandem.config import EngineConfig
from tandem.detokenizer import IncrementalDetokenizer
from tandem.engine_observer import EngineObserver
from tandem.model.llama import LlamaModel
from tandem.model_runner import ModelRunner
from tandem.outputs import RequestDelta
from tandem.sampling_params import SamplingParams
from tandem.scheduler import ScheduledBatch, Scheduler
from tandem.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model over one paged KV pool, stepped by the caller.

    ``step()`` schedules, runs the model and moves every scheduled request forward.
    """

    def __init__(self, config: EngineConfig, model: LlamaModel, tokenizer=None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.observer = observer
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(config, model)
        self.sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        logger.info(
            "KV pool: %d blocks of %d tokens (%d tokens, %.0f MiB); max_model_len %d",
            config.num_kv_blocks, config.block_size, config.num_kv_blocks * config.block_size,
            self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20,
            config.max_model_len,
        )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; raises ValueError at once when it could never run."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        self.scheduler.add(seq)
        return seq

    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int] | None:
        """Hold blocks for a prompt whose KV another worker computes. -> their ids, or None
        when the pool cannot hold it now. The leading blocks may be this pool's own cached
        prefix (shared, their KV already here): the sequence's num_cached_prompt_tokens
        counts their tokens, and only the rest must arrive. The request waits outside the
        scheduler until :meth:`start_prefilled`."""
        self.check_prompt(prompt_token_ids)  # before the room check: a prompt that never fits is a ValueError
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        cached_block_ids = self.block_manager.find_cached_prefix(seq)
        num_cached_tokens = len(cached_block_ids) * self.block_manager.block_size
        # Room for the prompt and the first decode step, beyond what running sequences hold.
        if not self.block_manager.can_allocate(seq, len(prompt_token_ids) - num_cached_tokens + 1, cached_block_ids):
            del self.sequences[request_id]
            return None
        self.block_manager.allocate(seq, len(prompt_token_ids) - num_cached_tokens, cached_block_ids)
        seq.num_cached_prompt_tokens = num_cached_tokens
        return list(seq.block_ids)

    def start_prefilled(self, request_id: str, first_token_id: int, first_logprob: float,
                        generator_state: torch.Tensor | None) -> RequestDelta:
        """The prompt KV of a reserved request has arrived and its first token was sampled:
        it joins the running batch (unless that token already ends it)."""
        seq = self.sequences[request_id]
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        self.block_manager.cache_full_blocks(seq)
        if seq.generator is not None and generator_state is not None:
            seq.generator.set_state(generator_state)
        self.scheduler.add_running(seq)
        u = self.scheduler.append_token(seq, first_token_id, first_logprob)
        if self.observer is not None:
            self.observer.on_first_token(seq)
        if seq.status.is_finished:
            self._remove(seq)
        return self._delta(seq, u.new_token_ids, u.new_text, u.new_logprobs)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        seq = Sequence(request_id, prompt_token_ids, params, next(self._arrivals), detokenizer)
        self.sequences[request_id] = seq
        return seq

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
        seq = self.scheduler.abort(request_id)
        if seq is None:
            seq = self.sequences.get(request_id)
            if seq is None:
                return None
            # Reserved for a prefill elsewhere, not yet started.
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
        self._remove(seq)
        return self._delta(seq, [], "", [])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self, layer_hook: Callable[[ScheduledBatch, int], None] | None = None) -> list[RequestDelta]:
        """layer_hook(batch, layer) runs as each layer's KV is stored (see LlamaModel.forward)."""
        batch = self.scheduler.schedule()
        self.runner.swap(batch)  # even with no sequence to run: the swap-outs must not wait
        if batch.is_empty:
            return []
        if self.observer is not None:
            self.observer.on_step(batch)
        sampled = self.runner.run(batch, None if layer_hook is None else functools.partial(layer_hook, batch))
        deltas = []
        for u in self.scheduler.update(batch, sampled):
            deltas.append(self._delta(u.seq, u.new_token_ids, u.new_text, u.new_logprobs))
            # A speculative step may add the first token and more after it.
            if self.observer is not None and u.seq.num_output_tokens == len(u.new_token_ids):
                self.observer.on_first_token(u.seq)
            if u.seq.status.is_finished:
                self._remove(u.seq)
        return deltas

    def _remove(self, seq: Sequence) -> None:
        """A finished sequence leaves the engine (its blocks are already freed, or kept)."""
        del self.sequences[seq.request_id]
        if self.observer is not None:
            self.observer.on_finished(seq)

    def _delta(self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[float]) -> RequestDelta:
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            new_text=text,
            new_logprobs=logprobs if seq.params.logprobs else None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens,
        )
