"""IncrementalDetokenizer on the real default tokenizer: streaming equals a full decode, and
stop strings cut the text without ever leaking a piece of themselves, on both text sources
(`tokenizers`' DecodeStream, the default for this fast tokenizer, and the window technique
it falls back to), which release the same text at the same steps."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from tandem.engine.decode_stream import INVALID_PREFIX_ERR_MSG, DecodeStreamText, stream_backend
from tandem.engine.detokenizer import IncrementalDetokenizer, TextDelta
from tandem.model.source import load_tokenizer, resolve_model_source

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 end",
    "中文测试：你好，世界！这是一个句子。日本語のテキストも。한국어 텍스트",
    "Accents: café, naïve, résumé, Ångström, Zürich, São Paulo, Łódź, ğüşıöç",
    "def f(x):\n    return x ** 2  # ∑ ∫ √ ≠ ≤ → ∞\n\n\tTabs and   spaces  ",
    "Mixed ①②③ ½ ¾ € £ ¥ ₹ — “quotes” ‘single’ … «guillemets» ℃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n好的 😀<|im_end|>",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_source(None))


@pytest.fixture(params=[True, False], ids=["decode_stream", "window"])
def decode_stream(request: Any) -> bool:
    """Which text source: DecodeStream (the default for a fast tokenizer), or the window
    technique, forced."""
    return request.param


def _stream(tokenizer: Any, ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
            decode_stream: bool = True, include_stop_str: bool = False,
            ) -> tuple[IncrementalDetokenizer, list[TextDelta], str]:
    detok = IncrementalDetokenizer(tokenizer, stop=stop, skip_special_tokens=skip_special_tokens,
                                   include_stop_str=include_stop_str, decode_stream=decode_stream)
    if hasattr(tokenizer, "_tokenizer"):
        assert detok.uses_decode_stream == decode_stream
    deltas = []
    for token_id in ids:
        delta = detok.append(token_id)
        deltas.append(delta)
        if delta.stopped:
            break
    return detok, deltas, detok.flush()


def _random_sequences(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """Uniform ids, ids biased to UTF-8 fragments (tokens decoding to "\\ufffd"), and
    shuffled real multi-byte text: all kinds of ways to split characters across tokens."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    fragments = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    assert len(fragments) > 50
    special = list(tokenizer.all_special_ids)
    real = [t for text in TEXTS for t in tokenizer.encode(text)]
    sequences = []
    for n in range(count):
        length = rng.randint(1, 40)
        kind = n % 3
        if kind == 0:
            ids = [rng.randrange(vocab) for _ in range(length)]
        elif kind == 1:
            ids = [rng.choice(fragments) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(length)]
        else:
            start = rng.randrange(len(real) - length)
            ids = real[start:start + length]
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        sequences.append(ids)
    return sequences


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode_on_real_text(tokenizer: Any, skip_special_tokens: bool,
                                                decode_stream: bool) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        detok, deltas, tail = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens,
                                      decode_stream=decode_stream)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(d.text for d in deltas) + tail == expected
        assert detok.output_text == expected
        assert not any(d.stopped for d in deltas)
        assert all("\ufffd" not in d.text for d in deltas), "a split character was streamed"
        if not skip_special_tokens:
            assert expected == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode_on_random_ids(tokenizer: Any, skip_special_tokens: bool,
                                                 decode_stream: bool) -> None:
    for ids in _random_sequences(tokenizer, count=300, seed=1 + skip_special_tokens):
        _, deltas, tail = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens,
                                  decode_stream=decode_stream)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(d.text for d in deltas) + tail == expected, ids


def test_stop_strings_that_never_complete_change_nothing(tokenizer: Any, decode_stream: bool) -> None:
    # Each stop string starts like text that occurs, so tails are held back, then released.
    stop = ("café!", "😀😀", "你好吗", "world?", "\n\n\n\n")
    for ids in [tokenizer.encode(t) for t in TEXTS] + _random_sequences(tokenizer, 60, seed=7):
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        if any(s in expected for s in stop):
            continue
        detok, deltas, tail = _stream(tokenizer, ids, stop=stop, decode_stream=decode_stream)
        assert not any(d.stopped for d in deltas)
        assert "".join(d.text for d in deltas) + tail == expected
        assert detok.output_text == expected


def _check_stop(tokenizer: Any, text: str | list[int], stop: tuple[str, ...], decode_stream: bool = True,
                include_stop_str: bool = False) -> list[TextDelta]:
    """Stream ``text``'s tokens (or these ids) and check the cut, the stopping step and the
    held-back text."""
    ids = tokenizer.encode(text) if isinstance(text, str) else text

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=True)

    # The first step whose decode contains a stop string is where streaming must stop, and
    # the text is cut before the earliest stop string in what is decoded by then (a longer
    # stop string that began earlier but has not completed does not count).
    stop_step = next(n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stop))
    full = decode(ids[:stop_step])
    cut, minus_length = min((i, -len(s)) for s in stop if (i := full.find(s)) >= 0)
    expected = full[:cut - minus_length] if include_stop_str else full[:cut]
    detok, deltas, tail = _stream(tokenizer, ids, stop=stop, decode_stream=decode_stream,
                                  include_stop_str=include_stop_str)
    assert len(deltas) == stop_step
    assert deltas[-1].stopped and not any(d.stopped for d in deltas[:-1])
    assert tail == ""
    assert detok.output_text == expected
    released = ""
    longest = max(len(s) for s in stop)
    for n, delta in enumerate(deltas[:-1], start=1):
        released += delta.text
        # Never a character past the cut (so no piece of the stop string), ...
        assert full[:cut].startswith(released)
        # ... and no more held back than a possible stop-string start, besides the tokens
        # of a character whose bytes are not all there yet.
        stable = next(d for d in (decode(ids[:m]) for m in range(n, -1, -1))
                      if not d.endswith("\ufffd"))
        assert len(released) >= len(stable) - (longest - 1)
    if not include_stop_str:
        assert not any(s in detok.output_text for s in stop)
    # Once stopped, further tokens are ignored.
    assert detok.append(ids[0]) == TextDelta("", True)
    assert detok.flush() == "" and detok.output_text == expected
    return deltas


def test_stop_string_spanning_token_boundaries(tokenizer: Any, decode_stream: bool) -> None:
    text = "The answer is forty-two, of course. Nothing more to say."
    stop = "y-two, of co"
    ids = tokenizer.encode(text)
    # The stop string must straddle several tokens for this test to mean anything.
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    _check_stop(tokenizer, text, (stop,), decode_stream)


def test_stop_string_with_false_starts(tokenizer: Any, decode_stream: bool) -> None:
    text = "a <EN b <E c <<END> d <END> e"
    deltas = _check_stop(tokenizer, text, ("<END>",), decode_stream)
    released = "".join(d.text for d in deltas)
    assert released == "a <EN b <E c <"
    # The false starts were held back only until they could no longer begin "<END>".
    first_b = next(i for i, d in enumerate(deltas) if "b" in d.text)
    assert "<EN" in "".join(d.text for d in deltas[:first_b + 1])


def test_stop_string_inside_a_multibyte_character_run(tokenizer: Any, decode_stream: bool) -> None:
    _check_stop(tokenizer, "Weather: ☀️ then 🌧️ then 😀 finally", ("😀",), decode_stream)
    _check_stop(tokenizer, "我们今天去公园散步，然后回家吃饭。", ("回家",), decode_stream)
    _check_stop(tokenizer, "résumé café naïveté", ("é ca",), decode_stream)


def test_earliest_of_several_stop_strings_wins(tokenizer: Any, decode_stream: bool) -> None:
    text = "one two three four five six"
    deltas = _check_stop(tokenizer, text, ("five", "two thr", "three f"), decode_stream)
    assert "".join(d.text for d in deltas) == "one "


def test_first_completed_stop_string_wins(tokenizer: Any, decode_stream: bool) -> None:
    # "bright" starts earlier but "right" completes first (at the same token): cut before it.
    deltas = _check_stop(tokenizer, "go bright now", ("bright n", "right"), decode_stream)
    assert "".join(d.text for d in deltas) == "go b"


def test_stop_string_at_the_very_start(tokenizer: Any, decode_stream: bool) -> None:
    deltas = _check_stop(tokenizer, "STOP right there", ("STOP",), decode_stream)
    assert all(d.text == "" for d in deltas)


def test_random_stop_strings_from_the_text(tokenizer: Any, decode_stream: bool) -> None:
    rng = random.Random(3)
    checked = 0
    for _ in range(80):
        text = rng.choice(TEXTS[:6])
        full = tokenizer.decode(tokenizer.encode(text))
        start = rng.randrange(len(full) - 1)
        stop = full[start:start + rng.randint(1, 8)]
        if not stop.strip() or "\ufffd" in stop:
            continue
        other = full[rng.randrange(len(full) - 1):][:rng.randint(2, 5)]
        _check_stop(tokenizer, text, (stop, other) if other.strip() else (stop,), decode_stream)
        checked += 1
    assert checked > 60


class _CountingTokenizer:
    """Wraps a tokenizer to count how many token ids all decodes together are handed."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.decoded_ids = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_work_per_token_is_bounded(tokenizer: Any, skip_special_tokens: bool) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 10)
    eos = tokenizer.eos_token_id
    ids = ids + [eos] * 300 + ids  # a run of EOS, as with ignore_eos
    counting = _CountingTokenizer(tokenizer)
    _, deltas, tail = _stream(counting, ids, stop=("never-there",), skip_special_tokens=skip_special_tokens)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert len(ids) > 1500
    # Two decodes of a window of a few tokens per step, not of the whole output.
    assert counting.decoded_ids < 12 * len(ids)


# DecodeStream (the fast path) against the window technique (the fallback).


def _added_special_ids(tokenizer: Any) -> list[int]:
    """Every special token of the backend (the default model has 17, only 3 of them in
    all_special_ids); decode skips them all."""
    return sorted({*tokenizer.all_special_ids,
                   *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)})


def _mixed_sequences(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """_random_sequences with any special token, and an emoji or CJK character cut short."""
    rng = random.Random(seed)
    special = _added_special_ids(tokenizer)
    split = [tokenizer.encode(c) for c in "😀🎉👍🏽🇫🇷你好世界語한𝔘"]
    split = [ids[:rng.randrange(1, len(ids))] for ids in split if len(ids) > 1]
    assert split, "these characters must take several tokens each"
    sequences = []
    for ids in _random_sequences(tokenizer, count, seed):
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
    assert not IncrementalDetokenizer(_CountingTokenizer(tokenizer)).uses_decode_stream
    # A fast tokenizer whose decode does more than its backend's: the window technique too.
    custom = copy.copy(tokenizer)
    custom.__class__ = type("OwnDecode", (type(tokenizer),), {"decode": lambda self, ids, **kw: "x"})
    assert stream_backend(custom) is None
    assert not IncrementalDetokenizer(custom).uses_decode_stream


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_both_sources_release_the_same_text_at_the_same_steps(tokenizer: Any, skip_special_tokens: bool) -> None:
    for ids in _mixed_sequences(tokenizer, count=400, seed=11 + skip_special_tokens):
        results = [_stream(tokenizer, ids, skip_special_tokens=skip_special_tokens, decode_stream=fast)
                   for fast in (True, False)]
        (_, fast_deltas, fast_tail), (_, window_deltas, window_tail) = results
        assert fast_deltas == window_deltas and fast_tail == window_tail, ids
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(d.text for d in fast_deltas) + fast_tail == expected, ids
        assert results[0][0].output_text == expected


def test_no_split_character_is_streamed(tokenizer: Any, decode_stream: bool) -> None:
    ids = tokenizer.encode("".join(TEXTS[1:3]) + " 👨‍👩‍👧‍👦𝔘😀")
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(len(ids))), "no character was split"
    _, deltas, tail = _stream(tokenizer, ids, decode_stream=decode_stream)
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids)
    # Cut short inside the last character: the flush holds what decode gives for it.
    _, deltas, tail = _stream(tokenizer, ids[:-1], decode_stream=decode_stream)
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
        fast, window = (_check_stop(tokenizer, ids, (stop,), decode_stream=path, include_stop_str=include_stop_str)
                        for path in (True, False))
        assert fast == window, (ids, stop)
        checked += 1
    assert checked > 60


class _RecordingStream:
    """Wraps a DecodeStreamText's stream: records the ids it is given; can fail one step."""

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
        source._stream = _RecordingStream(source._stream, fail_at)
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
    fast, window = (_stream(tokenizer, ids, decode_stream=path) for path in (True, False))
    assert fast[0].uses_decode_stream and fast[0]._source.fell_back
    assert fast[1:] == window[1:]


def test_other_decode_stream_errors_are_raised(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    source = detok._source
    assert isinstance(source, DecodeStreamText)
    source._stream = _RecordingStream(source._stream, 1, ValueError("something else"))
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
    source._stream = recording = _RecordingStream(source._stream)
    released = "".join(detok.append(t).text for t in ids) + detok.flush()
    assert released == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    # Skipped, they cost nothing; kept, they are text like any other token.
    assert recording.seen == ([t for t in ids if t not in special] if skip_special_tokens else ids)
