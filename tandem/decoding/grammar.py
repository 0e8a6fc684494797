"""Grammar-constrained decoding (structured outputs) on xgrammar: a request's
``StructuredOutputsParams`` compiled against the engine's tokenizer, and one matcher per
sequence that says which tokens may come next (a packed int32 bitmask, one bit a token) and
follows the tokens sampled.

xgrammar was chosen by ``tandem bench grammar``: the least time per token to fill the mask and
accept a token of the libraries measured (llguidance, outlines-core). Its price is compile time:
a nested JSON Schema takes a few hundred ms on 2 cores (any JSON object and short regexes a few
ms), so compiled grammars are cached and compiling belongs off the decode loop (xgrammar drops
the GIL while it compiles).

EOS: the engine's EOS ids are xgrammar's stop tokens, allowed exactly when the output so far is
a complete match; the tokenizer's other special tokens and ids past the tokenizer's length
(padding of the logits) are never allowed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar

from tandem.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_WHITESPACE = 20
"""Whitespace characters allowed in a row between JSON elements (room for pretty-printing;
a bound keeps a small model from looping on newlines forever)."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_MAX_MESSAGE = 200


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row: bit ``t % 32`` of word ``t // 32`` is token ``t``."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask ``[rows, bitmask_words(vocab_size)]`` with every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def _invalid(kind: str, error: Exception) -> ValueError:
    """A short message from xgrammar's error: its first line, without the C++ source location."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    message = _LOG_PREFIX.sub("", lines[0]).strip()
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    return ValueError(f"invalid structured output {kind}: {message}")


def _choice_ebnf(choices: Sequence[str]) -> str:
    # xgrammar's EBNF string literals take JSON's escapes (non-ASCII stays as UTF-8).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One compiled constraint, shared (read-only) by every matcher of every sequence using it."""

    key: tuple[str, str]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    compiled: Any = field(repr=False)
    """xgrammar.CompiledGrammar"""
    eos_row: torch.Tensor = field(repr=False)
    """A bitmask row allowing the EOS ids alone."""

    @property
    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class GrammarCompiler:
    """Compiles structured-output constraints for one engine's tokenizer; keeps the last
    ``cache_size`` compiled grammars (LRU by ``params.key``). ``compile`` may be called from
    several threads at once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None,
                 cache_size: int = 32, max_threads: int | None = None) -> None:
        """``tokenizer``: the engine's transformers tokenizer; ``vocab_size``: the logits'
        width (at least the tokenizer's length); ``eos_token_ids``: what ends a sequence
        (default: the tokenizer's EOS); ``max_threads``: xgrammar's compile threads."""
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
        eos = tuple(sorted(set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])))
        if not eos or not all(0 <= t < len(tokenizer) for t in eos):
            raise ValueError(f"EOS ids {eos} are not tokens of the tokenizer")
        self.vocab_size, self.eos_token_ids = vocab_size, eos
        self._info = _tokenizer_info(tokenizer, vocab_size, eos)
        threads = max_threads if max_threads is not None else min(2, os.cpu_count() or 1)
        # NOTE: xgrammar's own cache would grow without our bound on entries: ours replaces it.
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=threads, cache_enabled=False)
        self._eos_row = new_bitmask(1, vocab_size)[0].zero_()
        for t in eos:
            self._eos_row[t // 32] |= _bit(t % 32)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when it was compiled lately);
        ``ValueError`` with a short message when the schema, regex or choices are invalid."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, text = key
        start = time.perf_counter()
        try:
            if kind == "json":
                compiled = self._compiler.compile_json_schema(text, any_whitespace=True,
                                                              max_whitespace_cnt=MAX_WHITESPACE)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=True,
                                                              max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            else:
                compiled = self._compiler.compile_grammar(_choice_ebnf(params.choice))
        except Exception as e:
            raise _invalid(kind, e) from None
        grammar = CompiledGrammar(key, self.vocab_size, self.eos_token_ids, compiled, self._eos_row)
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        logger.debug("compiled a %s grammar in %.1f ms (%d bytes)", kind, (time.perf_counter() - start) * 1e3,
                     grammar.memory_bytes)
        return grammar


class GrammarMatcher:
    """Where one sequence stands in its grammar. Not thread-safe: one owner at a time."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self._version = 0
        self._terminated_at = (-1, False)  # (version, only EOS allowed then)
        self._scratch: torch.Tensor | None = None

    @classmethod
    def from_tokens(cls, grammar: CompiledGrammar, token_ids: Sequence[int]) -> GrammarMatcher:
        """A matcher that has accepted ``token_ids`` (the output so far, e.g. the token the
        prefill worker sampled); ``ValueError`` if they do not follow the grammar."""
        matcher = cls(grammar)
        for i, token_id in enumerate(token_ids):
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} at output position {i} does not follow the grammar")
        return matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar does not allow it."""
        token_id = int(token_id)
        if not 0 <= token_id < self.grammar.vocab_size or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self._version += 1
        return True

    @property
    def is_complete(self) -> bool:
        """The output so far is a full match: EOS is allowed (other tokens may be too)."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was accepted)."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        if self._terminated_at[0] != self._version:
            if self._scratch is None:
                self._scratch = new_bitmask(1, self.grammar.vocab_size)
            self._matcher.fill_next_token_bitmask(self._scratch)
            self._terminated_at = (self._version, bool(torch.equal(self._scratch[0], self.grammar.eos_row)))
        return self._terminated_at[1]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Write the allowed next tokens into row ``index`` of a host int32 ``bitmask``
        ``[rows, bitmask_words(vocab_size)]`` (after EOS: EOS alone)."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
                or bitmask.shape[1] != bitmask_words(self.grammar.vocab_size):
            raise ValueError(f"bitmask must be a host int32 [rows, {bitmask_words(self.grammar.vocab_size)}] "
                             f"tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if self._matcher.is_terminated():
            bitmask[index].copy_(self.grammar.eos_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index)


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 word as a Python int (bit 31 is the sign)."""
    return -(1 << 31) if position == 31 else 1 << position


def _tokenizer_info(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """xgrammar's view of the vocabulary, with every special token but EOS made unusable.

    NOTE: xgrammar takes special tokens whose text is not empty (``<|im_start|>``) for text,
    so ``.*`` would allow them; an empty string is what it never allows."""
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos))
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    special.update(detected.special_token_ids)
    if special <= set(eos):
        return detected
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = token
    metadata = json.loads(detected.dump_metadata())
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType(metadata["vocab_type"]), vocab_size=vocab_size,
                                  stop_token_ids=list(eos), add_prefix_space=metadata["add_prefix_space"])
