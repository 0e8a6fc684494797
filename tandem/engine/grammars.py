"""The engine's structured-output grammars: one compiler for the model's tokenizer, built on
first use (xgrammar is imported only then), and a fresh matcher per sequence."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.sampling_params import SamplingParams
from tandem.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from tandem.decoding.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher


class Grammars:
    """Thread-safe: a worker compiles a request's grammar on a thread of its own before
    handing the request to the engine loop (:meth:`compile`), which then finds it cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """-> the compiled grammar (cached); ValueError naming what is wrong with ``params``."""
        return self._get_compiler().compile(params)

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher at the start of the output for a request with structured outputs, else None."""
        if params.structured_outputs is None:
            return None
        from tandem.decoding.grammar import GrammarMatcher
        return GrammarMatcher(self.compile(params.structured_outputs))

    def _get_compiler(self) -> GrammarCompiler:
        with self._lock:  # (building one wraps the whole vocabulary: once, about a second)
            if self._compiler is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer, and this engine has none")
                from tandem.decoding.grammar import GrammarCompiler
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._compiler
