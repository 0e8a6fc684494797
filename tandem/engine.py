"""The engine core both pools run: admission, the step loop, abort."""

from __future__ import annotations

import itertools
import logging

from tandem.block_manager import BlockManager
from tandem.config import EngineConfig
from tandem.detokenizer import IncrementalDetokenizer
from tandem.model.llama import LlamaModel
from tandem.model_runner import ModelRunner
from tandem.outputs import RequestDelta
from tandem.sampling_params import SamplingParams
from tandem.scheduler import Scheduler
from tandem.sequence import Sequence

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model over one paged KV pool, stepped by the caller.

    ``step()`` schedules, runs the model and moves every scheduled request forward.
    """

    def __init__(self, config: EngineConfig, model: LlamaModel, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError at once when it could never run."""
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        seq = Sequence(request_id, prompt_token_ids, params, next(self._arrivals), detokenizer)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

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
            return None
        del self.sequences[request_id]
        return self._delta(seq, [], "", [])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestDelta]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled = self.runner.run(batch)
        deltas = []
        for u in self.scheduler.update(batch, sampled):
            deltas.append(self._delta(u.seq, u.new_token_ids, u.new_text, u.new_logprobs))
            if u.seq.status.is_finished:
                del self.sequences[u.seq.request_id]
        return deltas

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
