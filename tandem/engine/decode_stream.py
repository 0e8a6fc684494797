"""The fast text source of IncrementalDetokenizer: `tokenizers`' DecodeStream (as vLLM v1).

DecodeStream keeps the prefix/read window in Rust and hands back a chunk only once the text
of the tokens it holds is complete, so a step costs two small decodes without the Python
around ``tokenizer.decode``. Around it, this source adds what the window technique gave:

* text before a character whose UTF-8 bytes are not all here yet is taken at once (so a stop
  string is found at the same step on either path), by decoding the few held tokens;
* ``finish()`` returns what the stream still holds (a final incomplete character as
  "\\ufffd", as ``tokenizer.decode`` gives it);
* on DecodeStream's "Invalid prefix encountered" (a decoder whose output is not monotonic,
  vllm-project/vllm#17448) it hands the rest of the request to the window technique, seeded
  with the held tokens and their context, so no text is lost.

It is used only where ``tokenizer.decode`` is exactly the backend's decode
(:func:`stream_backend`); the output ids are streamed on their own, without the prompt,
because the text must equal ``tokenizer.decode(output_ids)``.
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# tokenizers' DecodeStreamError::InvalidPrefix (tokenizers/src/tokenizer/mod.rs); later
# releases add the token and the strings after it, hence a prefix match.
INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"
# DecodeStream appeared in 0.21; seeding it with ids (used after a flush) in 0.22.
_MIN_TOKENIZERS = (0, 22, 0)


class TextSource(Protocol):
    """Decoded text of a growing list of token ids, released as it becomes stable."""

    def add(self, token_id: int) -> str:
        """Add one token; return the text that is stable now and was not returned before."""
        ...

    def finish(self) -> str:
        """Return all text still held back (an incomplete last character as "\\ufffd")."""
        ...


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def stream_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` to stream with, or None where DecodeStream does not apply:
    not a fast tokenizer (slow ones, e.g. some GGUF-derived), a `tokenizers` too old, or a
    ``decode`` that does more than the backend's (a subclass's own, clean-up of spaces).
    Decided once per tokenizer."""
    try:
        return _BACKENDS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = _stream_backend(tokenizer)
    try:
        _BACKENDS[tokenizer] = backend
    except TypeError:  # not weakly referenceable: decided per request
        pass
    return backend


_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _stream_backend(tokenizer: Any) -> Any | None:
    try:
        import tokenizers
        import tokenizers.decoders
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if _version(tokenizers.__version__) < _MIN_TOKENIZERS or not hasattr(tokenizers.decoders, "DecodeStream"):
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers may clean up " ." into "." after the backend's decode (or not, for
        # BPE in recent releases): stream only where a probe shows it does not.
        probe = tokenizer.encode("a , b . c ! d ? e 's f n't g", add_special_tokens=False)
        for skip in (True, False):
            if tokenizer.decode(probe, skip_special_tokens=skip) != backend.decode(probe, skip_special_tokens=skip):
                return None
    return backend


class DecodeStreamText:
    """A :class:`TextSource` over ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, backend: Any, skip_special_tokens: bool,
                 fallback: Callable[[list[int], int, int], TextSource]) -> None:
        """``backend``: from :func:`stream_backend`; ``fallback(ids, read_offset, taken)``
        builds the window technique's source over ``ids``, whose first ``read_offset`` are
        context only and of whose decode the first ``taken`` characters are already taken
        (0: none past the context)."""
        from tokenizers.decoders import DecodeStream

        self._new_stream = DecodeStream
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._make_fallback = fallback
        self._fallback: TextSource | None = None
        # The tokens of the stream's last chunk: left context for decoding the held ones.
        self._context: list[int] = []
        self._context_len: int | None = None  # len(decode(context)), computed when needed
        # Tokens the stream holds (no chunk yet), and how many characters of their text were
        # already taken (the complete characters before an incomplete last one).
        self._held: list[int] = []
        self._early = 0

    @property
    def fell_back(self) -> bool:
        """Whether the stream broke ("Invalid prefix") and the window technique took over."""
        return self._fallback is not None

    def add(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.add(token_id)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as e:  # tokenizers raises a plain Exception for this
            if not str(e).startswith(INVALID_PREFIX_ERR_MSG):
                raise
            logger.warning("DecodeStream: %s; the window technique decodes the rest of this output", e)
            taken = self._decoded_context_len() + self._early if self._early else 0
            self._fallback = self._make_fallback(self._context + self._held, len(self._context), taken)
            return self._fallback.add(token_id)
        self._held.append(token_id)
        if chunk is None:
            return self._take_complete_characters()
        # The chunk is the whole text of the held tokens.
        text = chunk[self._early:]
        self._context, self._context_len = self._held, None
        self._held, self._early = [], 0
        return text

    def finish(self) -> str:
        if self._fallback is not None:
            return self._fallback.finish()
        if not self._held:
            return ""
        ids = self._context + self._held
        text = self._decode(ids)[self._decoded_context_len() + self._early:]
        # Tokens after a flush go on in context, from a stream that holds nothing.
        complete = not text.endswith(_REPLACEMENT_CHAR)
        self._stream = self._new_stream(ids=ids if complete else [], skip_special_tokens=self._skip_special_tokens)
        self._context, self._context_len = (ids, None) if complete else ([], 0)
        self._held, self._early = [], 0
        return text

    def _take_complete_characters(self) -> str:
        """The stream holds its tokens: take the text before a last incomplete character
        (what a step would release on the window path), by decoding the held tokens."""
        text = self._decode(self._context + self._held)
        start = self._decoded_context_len() + self._early
        stable = len(text.rstrip(_REPLACEMENT_CHAR))
        if stable <= start:
            return ""
        self._early = stable - self._decoded_context_len()
        return text[start:stable]

    def _decoded_context_len(self) -> int:
        if self._context_len is None:
            self._context_len = len(self._decode(self._context))
        return self._context_len

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
