"""The Python API, vLLM-style: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any, TypeGuard, Union, cast

import torch
from tqdm.auto import tqdm

from tandem.config import EngineConfig
from tandem.config.device import resolve_device, resolve_dtype
from tandem.config.engine_options import ENGINE_DEFAULTS, from_vllm_keywords
from tandem.engine.engine import LLMEngine
from tandem.engine.observer import EngineObserver
from tandem.engine.setup import engine_config_and_weights
from tandem.engine.step_threads import StepThreads
from tandem.model.dtypes import torch_dtype
from tandem.model.loader import LoadedModel, load_model
from tandem.model.source import ModelSource, resolve_model_source
from tandem.outputs import RequestDelta, RequestOutput
from tandem.parallel.launch import start_engine_model
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Message = dict[str, str]
"""A chat message: {"role": ..., "content": ...}."""
Prompt = Union[str, Sequence[int], dict[str, Any]]
"""Text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}."""


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt)


class LLM:
    """A model on one engine. ``model=None`` is the embedded default (SmolLM2-135M-Instruct);
    otherwise a local directory, a .gguf file or a Hugging Face hub id (at ``revision``).

    Other keyword arguments go to :meth:`EngineConfig.build` (kv_cache_dtype, block_size,
    kv_cache_memory_gib, num_kv_blocks, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
    swap_space_gib, num_swap_blocks, preemption_mode, num_speculative_tokens, quantization,
    tensor_parallel_size, seed, enforce_eager), whose defaults are the engine options' (tandem.config.engine_options),
    the same as ``tandem chat``'s and ``tandem serve``'s flags; vLLM's names are taken too
    (``swap_space``; ``disable_log_stats`` and the like without effect: see engine_options).
    With tensor_parallel_size > 1 the other ranks are Ray actors (call :meth:`shutdown` to
    stop them). ``observer`` and ``step_threads`` go to the engine (see LLMEngine): what
    watches its steps, and the torch threads each step takes by its size (as a served worker's).
    """

    def __init__(self, model: str | None = None, *, device: str = ENGINE_DEFAULTS["device"],
                 dtype: str = ENGINE_DEFAULTS["dtype"], num_threads: int | None = None, revision: str | None = None,
                 observer: EngineObserver | None = None, step_threads: StepThreads | None = None,
                 **engine_args: Any) -> None:
        engine_args = from_vllm_keywords(engine_args)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        # A bad device or dtype is refused before anything loads.
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        source = resolve_model_source(model, revision)
        self._start(load_model(source, torch_dtype(dtype)), dict(engine_args, device=device, dtype=dtype), source,
                    model, num_threads, revision, observer=observer, step_threads=step_threads)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, *, observer: EngineObserver | None = None,
                    **engine_args: Any) -> LLM:
        """A fresh engine on weights already loaded (tests and benchmarks share one load)."""
        llm = cls.__new__(cls)
        llm._start(loaded, engine_args, observer=observer)
        return llm

    def _start(self, loaded: LoadedModel, engine_args: dict[str, Any], source: ModelSource | None = None,
               model: str | None = None, num_threads: int | None = None, revision: str | None = None, *,
               observer: EngineObserver | None = None, step_threads: StepThreads | None = None) -> None:
        """source: the files ``loaded`` came from (see loader.quantized). model: where the
        other ranks load the weights from, with tensor_parallel_size > 1 (Ray actors, on a
        local Ray unless one is running; see parallel.ranks)."""
        self.tokenizer = loaded.tokenizer
        config, loaded = engine_config_and_weights(loaded, engine_args, source)
        started = start_engine_model(loaded, config, model, num_threads, revision=revision)
        self._ranks = started.ranks
        self.engine = LLMEngine(config, started.model, self.tokenizer, runner=started.runner, observer=observer,
                                step_threads=step_threads)
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at tp=1); generate no more after."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """-> (token ids, text or None) of one prompt."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), None
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            assert self.tokenizer is not None, "this model has no tokenizer: prompts must be token ids"
            return self.tokenizer.encode(prompt), prompt
        if _is_token_ids(prompt):
            return list(prompt), None
        raise TypeError(f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}")

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"a chat message is {{'role': str, 'content': str}}, got {m!r}")
        assert self.tokenizer is not None, "this model has no tokenizer: prompts must be token ids"
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to the end in one continuous batch; outputs in prompt order."""
        one = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        )
        batch = [cast(Prompt, prompts)] if one else cast(Sequence[Prompt], prompts)
        encoded = [self.encode(p) for p in batch]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation, or a list of them, rendered with the model's chat template."""
        one = messages and isinstance(messages[0], dict)
        conversations = [cast(Sequence[Message], messages)] if one else cast(Sequence[Sequence[Message]], messages)
        encoded: list[tuple[list[int], str | None]] = [(self.apply_chat_template(c), None) for c in conversations]
        return self._run(encoded, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestDelta]:
        """Yield one request's deltas as they are made; closing the iterator aborts it."""
        token_ids, _ = self.encode(prompt)
        request_id = self._add(token_ids, sampling_params or SamplingParams())
        finished = False
        try:
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        finished = delta.request_finished
                        yield delta
        finally:
            if not finished:
                self.engine.abort_request(request_id)

    def _add(self, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._request_ids))
        self.engine.add_request(request_id, token_ids, params)
        return request_id

    def _run(self, encoded: list[tuple[list[int], str | None]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(f"{len(params)} sampling params for {len(encoded)} prompts")
        for token_ids, _ in encoded:  # refuse the whole call before queueing any of it
            self.engine.check_prompt(token_ids)
        outputs: dict[str, RequestOutput] = {}
        for (token_ids, text), p in zip(encoded, params):
            request_id = self._add(token_ids, p)
            outputs[request_id] = RequestOutput(request_id, token_ids, prompt=text)
        progress = tqdm(total=len(outputs), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished:
                for delta in self.engine.step():
                    if delta.request_id in outputs:
                        outputs[delta.request_id].add(delta)
                        progress.update(delta.request_finished)
        finally:
            progress.close()
            for request_id, out in outputs.items():
                if not out.finished:  # interrupted: leave nothing behind in the engine
                    self.engine.abort_request(request_id)
        return list(outputs.values())
