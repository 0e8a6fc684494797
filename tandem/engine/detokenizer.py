"""Incremental detokenization of one request's output, with stop strings.

Each step decodes only a short window of recent tokens and releases the text it adds (the
prefix_offset / read_offset technique of TGI and vLLM), so a step costs O(window), not
O(output). Text is held back twice: while the decode ends in an incomplete UTF-8 sequence
("\\ufffd"), and while its tail could still become the start of a stop string, so that no
part of a stop string is ever streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
                 include_stop_str: bool = False) -> None:
        """``tokenizer`` is a transformers tokenizer; ``stop`` are non-empty stop strings;
        include_stop_str: the text ends after the stop string found, not before it."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._include_stop_str = include_stop_str
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        # Tokens [prefix_offset, read_offset) decode to text already taken from the decoder;
        # they are re-decoded only as context for the tokens after them.
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_taken = 0  # chars of decode(window) already taken past prefix_text
        self._pending = ""  # decoded text not yet released (a possible stop-string start)
        self._released: list[str] = []
        self._stopped = False
        # Special tokens the decode would skip anyway are never added to the window, so a run
        # of them (e.g. EOS with ignore_eos) cannot make the window, and each step, grow.
        self._skipped_ids: frozenset[int] = frozenset(
            t for t in getattr(tokenizer, "all_special_ids", ())
            if skip_special_tokens and tokenizer.decode([t], skip_special_tokens=True) == ""
        )

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
        self._token_ids.append(token_id)
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At finish (length, EOS, stop token): return all text still held back."""
        if self._stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._release(final=True).text

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

    def _release(self, final: bool) -> TextDelta:
        """Move pending text out, cutting at the earliest stop string and holding back a tail
        that could still begin one."""
        pending = self._pending
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
