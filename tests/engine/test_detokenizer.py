"""IncrementalDetokenizer on the real default tokenizer: streaming equals a full decode, and
stop strings cut the text without ever leaking a piece of themselves, on both text sources
(`tokenizers`' DecodeStream, the default for this fast tokenizer, and the window technique
it falls back to). The two sources against each other: test_detokenizer_sources.py."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer, TextDelta

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


def stream_ids(tokenizer: Any, ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
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


def random_sequences(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
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
        detok, deltas, tail = stream_ids(tokenizer, ids, skip_special_tokens=skip_special_tokens,
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
    for ids in random_sequences(tokenizer, count=300, seed=1 + skip_special_tokens):
        _, deltas, tail = stream_ids(tokenizer, ids, skip_special_tokens=skip_special_tokens,
                                  decode_stream=decode_stream)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(d.text for d in deltas) + tail == expected, ids


def test_stop_strings_that_never_complete_change_nothing(tokenizer: Any, decode_stream: bool) -> None:
    # Each stop string starts like text that occurs, so tails are held back, then released.
    stop = ("café!", "😀😀", "你好吗", "world?", "\n\n\n\n")
    for ids in [tokenizer.encode(t) for t in TEXTS] + random_sequences(tokenizer, 60, seed=7):
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        if any(s in expected for s in stop):
            continue
        detok, deltas, tail = stream_ids(tokenizer, ids, stop=stop, decode_stream=decode_stream)
        assert not any(d.stopped for d in deltas)
        assert "".join(d.text for d in deltas) + tail == expected
        assert detok.output_text == expected


def check_stop(tokenizer: Any, text: str | list[int], stop: tuple[str, ...], decode_stream: bool = True,
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
    detok, deltas, tail = stream_ids(tokenizer, ids, stop=stop, decode_stream=decode_stream,
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
    check_stop(tokenizer, text, (stop,), decode_stream)


def test_stop_string_with_false_starts(tokenizer: Any, decode_stream: bool) -> None:
    text = "a <EN b <E c <<END> d <END> e"
    deltas = check_stop(tokenizer, text, ("<END>",), decode_stream)
    released = "".join(d.text for d in deltas)
    assert released == "a <EN b <E c <"
    # The false starts were held back only until they could no longer begin "<END>".
    first_b = next(i for i, d in enumerate(deltas) if "b" in d.text)
    assert "<EN" in "".join(d.text for d in deltas[:first_b + 1])


def test_stop_string_inside_a_multibyte_character_run(tokenizer: Any, decode_stream: bool) -> None:
    check_stop(tokenizer, "Weather: ☀️ then 🌧️ then 😀 finally", ("😀",), decode_stream)
    check_stop(tokenizer, "我们今天去公园散步，然后回家吃饭。", ("回家",), decode_stream)
    check_stop(tokenizer, "résumé café naïveté", ("é ca",), decode_stream)


def test_earliest_of_several_stop_strings_wins(tokenizer: Any, decode_stream: bool) -> None:
    text = "one two three four five six"
    deltas = check_stop(tokenizer, text, ("five", "two thr", "three f"), decode_stream)
    assert "".join(d.text for d in deltas) == "one "


def test_first_completed_stop_string_wins(tokenizer: Any, decode_stream: bool) -> None:
    # "bright" starts earlier but "right" completes first (at the same token): cut before it.
    deltas = check_stop(tokenizer, "go bright now", ("bright n", "right"), decode_stream)
    assert "".join(d.text for d in deltas) == "go b"


def test_stop_string_at_the_very_start(tokenizer: Any, decode_stream: bool) -> None:
    deltas = check_stop(tokenizer, "STOP right there", ("STOP",), decode_stream)
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
        check_stop(tokenizer, text, (stop, other) if other.strip() else (stop,), decode_stream)
        checked += 1
    assert checked > 60


class CountingTokenizer:
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
    counting = CountingTokenizer(tokenizer)
    _, deltas, tail = stream_ids(counting, ids, stop=("never-there",), skip_special_tokens=skip_special_tokens)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert len(ids) > 1500
    # Two decodes of a window of a few tokens per step, not of the whole output.
    assert counting.decoded_ids < 12 * len(ids)
