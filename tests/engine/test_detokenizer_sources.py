"""IncrementalDetokenizer's two text sources against each other: `tokenizers`' DecodeStream (the
fast path, chosen for a fast tokenizer) and the window technique (its fallback) release the same
text at the same steps, never a split character; DecodeStream's "invalid prefix" hands over to
the window technique mid-request, other errors are raised, and skipped special tokens never
reach the stream. The shared helpers are test_detokenizer.py's."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from test_detokenizer import TEXTS, CountingTokenizer, check_stop, random_sequences, stream_ids

from tandem.engine.decode_stream import INVALID_PREFIX_ERR_MSG, DecodeStreamText, stream_backend
from tandem.engine.detokenizer import IncrementalDetokenizer


def _added_special_ids(tokenizer: Any) -> list[int]:
    """Every special token of the backend (the default model has 17, only 3 of them in
    all_special_ids); decode skips them all."""
    return sorted({*tokenizer.all_special_ids,
                   *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)})


def _mixed_sequences(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """random_sequences with any special token, and an emoji or CJK character cut short."""
    rng = random.Random(seed)
    special = _added_special_ids(tokenizer)
    split = [tokenizer.encode(c) for c in "😀🎉👍🏽🇫🇷你好世界語한𝔘"]
    split = [ids[:rng.randrange(1, len(ids))] for ids in split if len(ids) > 1]
    assert split, "these characters must take several tokens each"
    sequences = []
    for ids in random_sequences(tokenizer, count, seed):
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        if rng.random() < 0.3:
            ids += rng.choice(split)  # ends mid-character: flush gives "\ufffd", as decode does
        sequences.append(ids)
    return sequences


def test_the_fast_path_is_chosen_for_the_default_tokenizer(tokenizer: Any) -> None:
    assert stream_backend(tokenizer) is tokenizer._tokenizer
    assert IncrementalDetokenizer(tokenizer).uses_decode_stream
    assert IncrementalDetokenizer(tokenizer, stop=("x",), skip_special_tokens=False).uses_decode_stream
    assert not IncrementalDetokenizer(tokenizer, decode_stream=False).uses_decode_stream
    # Not a fast tokenizer (any object with decode): the window technique.
    assert not IncrementalDetokenizer(CountingTokenizer(tokenizer)).uses_decode_stream
    # A fast tokenizer whose decode does more than its backend's: the window technique too.
    custom = copy.copy(tokenizer)
    custom.__class__ = type("OwnDecode", (type(tokenizer),), {"decode": lambda self, ids, **kw: "x"})
    assert stream_backend(custom) is None
    assert not IncrementalDetokenizer(custom).uses_decode_stream


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_both_sources_release_the_same_text_at_the_same_steps(tokenizer: Any, skip_special_tokens: bool) -> None:
    for ids in _mixed_sequences(tokenizer, count=400, seed=11 + skip_special_tokens):
        results = [stream_ids(tokenizer, ids, skip_special_tokens=skip_special_tokens, decode_stream=fast)
                   for fast in (True, False)]
        (_, fast_deltas, fast_tail), (_, window_deltas, window_tail) = results
        assert fast_deltas == window_deltas and fast_tail == window_tail, ids
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(d.text for d in fast_deltas) + fast_tail == expected, ids
        assert results[0][0].output_text == expected


def test_no_split_character_is_streamed(tokenizer: Any, decode_stream: bool) -> None:
    ids = tokenizer.encode("".join(TEXTS[1:3]) + " 👨‍👩‍👧‍👦𝔘😀")
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(len(ids))), "no character was split"
    _, deltas, tail = stream_ids(tokenizer, ids, decode_stream=decode_stream)
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids)
    # Cut short inside the last character: the flush holds what decode gives for it.
    _, deltas, tail = stream_ids(tokenizer, ids[:-1], decode_stream=decode_stream)
    assert all("\ufffd" not in d.text for d in deltas) and tail.endswith("\ufffd")
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("include_stop_str", [False, True])
def test_random_stop_strings_across_token_boundaries(tokenizer: Any, include_stop_str: bool) -> None:
    rng = random.Random(17 + include_stop_str)
    checked = 0
    for ids in _mixed_sequences(tokenizer, count=240, seed=23):
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 4:
            continue
        start = rng.randrange(len(full) - 2)
        stop = full[start:start + rng.randint(2, 6)]
        if "\ufffd" in stop or not stop.strip():
            continue
        # Only stop strings no single token holds: they complete across a token boundary.
        if any(stop in tokenizer.decode([t], skip_special_tokens=True) for t in ids):
            continue
        fast, window = (check_stop(tokenizer, ids, (stop,), decode_stream=path, include_stop_str=include_stop_str)
                        for path in (True, False))
        assert fast == window, (ids, stop)
        checked += 1
    assert checked > 60


class _RecordingStream:
    """Wraps a DecodeStreamText's stream: records the ids it is given; can fail one step."""

    @classmethod
    def put_in(cls, source: DecodeStreamText, fail_at: int | None = None,
               error: Exception = Exception(INVALID_PREFIX_ERR_MSG + " while decoding stream")) -> _RecordingStream:
        """One in place of the source's stream, wrapping it."""
        recording = cls(source._stream, fail_at, error)
        # A stand-in for `tokenizers`' DecodeStream, a Rust type that cannot be subclassed.
        source._stream = recording  # type: ignore[assignment]
        return recording

    def __init__(self, inner: Any, fail_at: int | None = None,
                 error: Exception = Exception(INVALID_PREFIX_ERR_MSG + " while decoding stream")) -> None:
        self.inner, self.fail_at, self.error = inner, fail_at, error
        self.seen: list[int] = []

    def step(self, backend: Any, token_id: int) -> str | None:
        self.seen.append(token_id)
        if len(self.seen) == self.fail_at:
            raise self.error
        return self.inner.step(backend, token_id)


def test_an_invalid_prefix_hands_over_to_the_window_technique(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab 😀 你好 🇫🇷 done, " + TEXTS[1])
    expected = tokenizer.decode(ids)
    held_at_failure = taken_at_failure = 0
    for fail_at in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, stop=("never there",))
        source = detok._source
        assert isinstance(source, DecodeStreamText)
        _RecordingStream.put_in(source, fail_at)
        texts = []
        for n, token_id in enumerate(ids, start=1):
            if n == fail_at:
                # The stream holds part of a character, and maybe text before it, taken already.
                held_at_failure += bool(source._held)
                taken_at_failure += bool(source._early)
            texts.append(detok.append(token_id).text)
        assert source.fell_back
        assert "".join(texts) + detok.flush() == expected, fail_at
        assert all("\ufffd" not in t for t in texts)
    assert held_at_failure and taken_at_failure, "no failure came in the middle of a character"


def test_a_real_invalid_prefix_from_a_non_monotonic_decoder() -> None:
    # A decoder that rewrites text already decoded ("ab" -> "X" once "b" comes) makes
    # DecodeStream raise "Invalid prefix encountered"; the window technique takes over, and
    # the text is the window technique's all along (neither can be exact for such a decoder).
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3, " ": 4}, unk_token="[UNK]"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    ids = [3, 1, 2, 4, 1, 1, 2, 3, 2, 1, 4, 2]
    fast, window = (stream_ids(tokenizer, ids, decode_stream=path) for path in (True, False))
    source = fast[0]._source
    assert isinstance(source, DecodeStreamText) and source.fell_back
    assert fast[1:] == window[1:]


def test_other_decode_stream_errors_are_raised(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    source = detok._source
    assert isinstance(source, DecodeStreamText)
    _RecordingStream.put_in(source, 1, ValueError("something else"))
    with pytest.raises(ValueError, match="something else"):
        detok.append(tokenizer.encode("hi")[0])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skipped_special_tokens_never_reach_the_stream(tokenizer: Any, skip_special_tokens: bool) -> None:
    text = tokenizer.encode(TEXTS[0] + TEXTS[2])
    special = _added_special_ids(tokenizer)
    ids = text + [tokenizer.eos_token_id] * 300 + special * 20 + text
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    source = detok._source
    assert isinstance(source, DecodeStreamText)
    recording = _RecordingStream.put_in(source)
    released = "".join(detok.append(t).text for t in ids) + detok.flush()
    assert released == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    # Skipped, they cost nothing; kept, they are text like any other token.
    assert recording.seen == ([t for t in ids if t not in special] if skip_special_tokens else ids)
