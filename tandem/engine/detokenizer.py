"""Incremental detokenization of one request's output, with stop strings.

The text comes from one of two sources, chosen per request: `tokenizers`' DecodeStream
(:mod:`tandem.engine.decode_stream`) for a fast tokenizer, as vLLM v1 does, or else the
prefix_offset / read_offset window technique of TGI and vLLM (:class:`WindowText`). Either
decodes only a short window of recent tokens per step, so a step costs O(window), not
O(output). Text is held back twice: while the decode ends in an incomplete UTF-8 sequence
("\\ufffd"), and while its tail could still become the start of a stop string, so that no
part of a stop string is ever streamed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from tandem.engine.decode_stream import DecodeStreamText, TextSource, stream_backend

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    """Result of appending one token."""

    text: str
    """Text newly released since the last call; may be empty."""
    stopped: bool
    """A stop string was found; ``text`` ends just before it and the request should finish."""


class IncrementalDetokenizer:
    """Turns output token ids into text, one token at a time.

    Concatenating every ``append(...).text`` and the final ``flush()`` gives
    ``tokenizer.decode(all_ids, skip_special_tokens=...)`` unless a stop string cut it.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop_str: bool = False, decode_stream: bool = True) -> None:
        """``tokenizer`` is a transformers tokenizer; ``stop`` are non-empty stop strings;
        include_stop_str: the text ends after the stop string found, not before it;
        decode_stream: use DecodeStream where the tokenizer allows it (False: always the
        window technique)."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._stop_inner_chars = frozenset(c for s in stop for c in s[:-1])
        self._include_stop_str = include_stop_str
        self._pending = ""  # decoded text not yet released (a possible stop-string start)
        self._released: list[str] = []
        self._stopped = False
        # Special tokens the decode would skip anyway never reach the text source, so a run
        # of them (e.g. EOS with ignore_eos) cannot make its window, and each step, grow.
        self._skipped_ids = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()

        def window(ids: Sequence[int] = (), read_offset: int = 0, taken: int = 0) -> WindowText:
            return WindowText(tokenizer, skip_special_tokens, ids, read_offset, taken)

        backend = stream_backend(tokenizer) if decode_stream else None
        self._source: TextSource = (window() if backend is None
                                    else DecodeStreamText(backend, skip_special_tokens, window))

    @property
    def uses_decode_stream(self) -> bool:
        """Whether the text comes from `tokenizers`' DecodeStream (not the window technique)."""
        return isinstance(self._source, DecodeStreamText)

    @property
    def output_text(self) -> str:
        """All text released so far (held-back text excluded)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been found."""
        return self._stopped

    def append(self, token_id: int) -> TextDelta:
        """Add one generated token; return the text it makes stable."""
        if self._stopped:
            # The request has finished; tokens after the stop string are dropped.
            return TextDelta("", True)
        if token_id in self._skipped_ids:
            return TextDelta("", False)
        self._pending += self._source.add(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """At finish (length, EOS, stop token): return all text still held back."""
        if self._stopped:
            return ""
        self._pending += self._source.finish()
        return self._release(final=True).text

    def _release(self, final: bool) -> TextDelta:
        """Move pending text out, cutting at the earliest stop string and holding back a tail
        that could still begin one."""
        pending = self._pending
        if not self._stop:
            self._pending = ""
            return self._emit(pending, stopped=False)
        # Held-back text is always a proper prefix of a stop string, so any stop string that
        # completes now lies entirely inside pending: searching pending alone is enough.
        found = [(i, -len(s)) for s in self._stop if (i := pending.find(s)) >= 0]
        if found:
            cut, minus_length = min(found)  # the earliest; of those starting there, the longest
            self._stopped = True
            self._pending = ""
            return self._emit(pending[:cut - minus_length if self._include_stop_str else cut], stopped=True)
        hold = 0 if final else self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return self._emit(pending[: len(pending) - hold], stopped=False)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_inner_chars:
            return 0  # no proper prefix of a stop string ends with this character
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, text: str, stopped: bool) -> TextDelta:
        if text:
            self._released.append(text)
        return TextDelta(text, stopped)


class WindowText:
    """The window technique as a :class:`TextSource`: each step decodes the tokens from
    prefix_offset on, and takes the text they add past the decode of [prefix_offset,
    read_offset). Works with any tokenizer that has ``decode``."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, ids: Sequence[int] = (),
                 read_offset: int = 0, taken: int = 0) -> None:
        """``ids``: tokens already there, the first ``read_offset`` of them context only;
        ``taken``: characters of their decode already taken (0: none past the context)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(ids)
        # Tokens [prefix_offset, read_offset) decode to text already taken from the decoder;
        # they are re-decoded only as context for the tokens after them.
        self._prefix_offset = 0
        self._read_offset = read_offset
        self._window_taken = taken  # chars of decode(window) already taken past prefix_text

    def add(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        return self._decode_new(final=False)

    def finish(self) -> str:
        return self._decode_new(final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _decode_new(self, final: bool) -> str:
        """Text the tokens after read_offset add to the window, up to any split character."""
        # Decoding from prefix_offset rather than read_offset gives the decoder the context
        # it needs (e.g. SentencePiece drops a word's leading space at the start of a decode).
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(prefix_text) and not final:
            # Nothing visible yet (e.g. a skipped special token): keep the window as it is.
            return ""
        start = max(len(prefix_text), self._window_taken)
        if final or not new_text.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            self._window_taken = 0
            return new_text[start:]
        # The last character's UTF-8 bytes are not all here yet, so the window cannot move
        # on; the text before it is final though (UTF-8 decoding resynchronises after each
        # complete character), so take it now: a stop string in it is found a step sooner.
        stable = len(new_text.rstrip(_REPLACEMENT_CHAR))
        if stable <= start:
            return ""
        self._window_taken = stable
        return new_text[start:stable]


_SKIPPED_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Special tokens that ``decode(..., skip_special_tokens=True)`` drops: the tokenizer's
    special ids and the added tokens marked special (a backend skips those too). Computed
    once per tokenizer."""
    try:
        return _SKIPPED_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        candidates.update(i for i, token in added.items() if getattr(token, "special", False))
    skipped = frozenset(t for t in candidates if tokenizer.decode([t], skip_special_tokens=True) == "")
    try:
        _SKIPPED_IDS[tokenizer] = skipped
    except TypeError:  # not weakly referenceable: computed per request
        pass
    return skipped
