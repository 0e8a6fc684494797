"""Structured outputs on the default model's tokenizer: random walks through each kind of
grammar (JSON Schema, any JSON object, regex, choice), checked by independent parsers
(json, jsonschema, re), and the matcher's and the mask's contracts."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from tandem.decoding.grammar import GrammarCompiler, GrammarMatcher, bitmask_words, new_bitmask
from tandem.decoding.grammar_mask import apply_grammar_masks, apply_grammar_masks_reference, unpack_bitmask
from tandem.structured_outputs import StructuredOutputsParams

PADDING = 64  # logits wider than the tokenizer, as padded vocabularies are
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"(Mon|Tue|Wed), [0-9]{2} [A-Z][a-z]{2,8} [0-9]{4}; [a-z0-9._]{1,12}@[a-z]{2,10}\.(com|org)"
CHOICES = ("yes", "no", "a", "ab", 'say "hi"', "back\\slash", "ünïcode ☃")
PARAMS = {
    "json_schema": StructuredOutputsParams(json=json.dumps(SCHEMA)),  # text: the declared key order
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
}
VALID = {
    "json_schema": '{"name": "Ada", "age": 36, "role": "admin", "tags": ["x"], '
                   '"address": {"city": "Paris", "zip": "75001"}}',
    "json_object": '{"a": [1, {"b": null}], "c": "d"}',
    "regex": "Tue, 14 March 2023; ada.l@example.org",
    "choice": 'say "hi"',
}


def check_output(kind: str, text: str) -> None:
    """The independent check: Python's own parsers, not the grammar library."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer) + PADDING)


@pytest.fixture(scope="module")
def closing(tokenizer) -> torch.Tensor:
    """+8 on tokens that close strings, objects and arrays, so that a random walk through
    unbounded JSON ends (ASCII stands for itself in byte-level BPE token strings)."""
    bias = torch.zeros(len(tokenizer) + PADDING)
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if any(c in token for c in '"}]'):
            bias[i] = 8.0
    return bias


def allowed_ids(matcher: GrammarMatcher) -> set[int]:
    bitmask = new_bitmask(1, matcher.grammar.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return set(unpack_bitmask(bitmask, matcher.grammar.vocab_size)[0].nonzero().flatten().tolist())


def random_walk(grammar, tokenizer, closing: torch.Tensor, seed: int, max_tokens: int = 600) -> list[int]:
    """Tokens drawn from random logits under the grammar's masks until EOS (EOS included)."""
    generator = torch.Generator().manual_seed(seed)
    matcher, tokens, eos = GrammarMatcher(grammar), [], list(grammar.eos_token_ids)
    special = sorted(set(tokenizer.all_special_ids) - set(eos))
    for step in range(max_tokens):
        logits = torch.randn((1, grammar.vocab_size), generator=generator) * 2
        masked = apply_grammar_masks(logits + (closing if step >= 12 else 0), [matcher])
        row = masked[0]
        assert not torch.isfinite(row[len(tokenizer):]).any() and not torch.isfinite(row[special]).any()
        eos_allowed = bool(torch.isfinite(row[eos]).any())
        assert eos_allowed == matcher.is_complete  # EOS exactly when the output is complete
        if eos_allowed:
            assert matcher.is_terminated == (int(torch.isfinite(row).sum()) == int(torch.isfinite(row[eos]).sum()))
        token = int(masked[0].argmax())
        assert matcher.accept_token(token)
        tokens.append(token)
        if token in eos:
            assert matcher.is_terminated
            return tokens
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("kind", list(PARAMS))
def test_random_walks_give_valid_outputs(kind, compiler, tokenizer, closing):
    grammar = compiler.compile(PARAMS[kind])
    outputs = set()
    for seed in range(12):
        tokens = random_walk(grammar, tokenizer, closing, seed)
        text = tokenizer.decode(tokens[:-1])
        check_output(kind, text)
        outputs.add(text)
    assert len(outputs) > 1  # the walks were random


@pytest.mark.parametrize("kind", list(PARAMS))
def test_a_valid_output_is_accepted_and_terminates(kind, compiler, tokenizer):
    grammar = compiler.compile(PARAMS[kind])
    matcher = GrammarMatcher.from_tokens(grammar, tokenizer.encode(VALID[kind], add_special_tokens=False))
    assert matcher.is_complete and matcher.is_terminated
    assert allowed_ids(matcher) == {tokenizer.eos_token_id}
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated
    assert not matcher.accept_token(tokenizer.eos_token_id)
    assert allowed_ids(matcher) == {tokenizer.eos_token_id}  # after EOS still only EOS


def test_complete_but_extendable_is_not_terminated(compiler, tokenizer):
    matcher = GrammarMatcher.from_tokens(compiler.compile(PARAMS["choice"]), tokenizer.encode("a"))
    assert matcher.is_complete and not matcher.is_terminated  # "a" or "ab"
    assert {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("b")} <= allowed_ids(matcher)


def test_a_refused_token_leaves_the_state_intact(compiler, tokenizer):
    grammar = compiler.compile(PARAMS["json_schema"])
    tokens = tokenizer.encode(VALID["json_schema"], add_special_tokens=False)
    matcher = GrammarMatcher.from_tokens(grammar, tokens[:5])
    before = allowed_ids(matcher)
    refused = [t for t in (tokenizer.eos_token_id, 1, tokenizer.encode("}")[0], tokenizer.encode(" zebra")[0],
                           len(tokenizer), grammar.vocab_size, grammar.vocab_size + 7, -1) if t not in before]
    assert len(refused) >= 6
    for token in refused:
        assert not matcher.accept_token(token)
        assert allowed_ids(matcher) == before
    for token in tokens[5:]:
        assert matcher.accept_token(token)
    assert matcher.is_terminated


def test_replay_equals_incremental(compiler, tokenizer, closing):
    grammar = compiler.compile(PARAMS["json_object"])
    tokens = random_walk(grammar, tokenizer, closing, seed=99)
    incremental = GrammarMatcher(grammar)
    for i, token in enumerate(tokens):
        if i % 3 == 0 or i == len(tokens) - 1:
            replayed = GrammarMatcher.from_tokens(grammar, tokens[:i])
            assert allowed_ids(replayed) == allowed_ids(incremental)
            assert ((replayed.is_complete, replayed.is_terminated)
                    == (incremental.is_complete, incremental.is_terminated))
        assert incremental.accept_token(token)
    prefix = tokenizer.encode('{"a":')
    with pytest.raises(ValueError, match=f"position {len(prefix)} "):
        GrammarMatcher.from_tokens(grammar, prefix + tokenizer.encode("}"))


def test_masks_unpack_exactly(compiler, tokenizer, closing):
    vocab_size = compiler.vocab_size
    matchers: list[GrammarMatcher | None] = [None]
    for kind, params in PARAMS.items():
        tokens = tokenizer.encode(VALID[kind], add_special_tokens=False)
        matchers += [GrammarMatcher.from_tokens(compiler.compile(params), tokens[:n]) for n in (0, len(tokens) // 2)]
        matchers.append(None)
    matchers.append(GrammarMatcher.from_tokens(compiler.compile(PARAMS["choice"]), tokenizer.encode("no") + [2]))
    logits = torch.randn(len(matchers), vocab_size, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    fast, reference = apply_grammar_masks(logits, matchers), apply_grammar_masks_reference(logits, matchers)
    assert torch.equal(logits, raw)  # the input is left alone
    assert torch.equal(fast, reference)
    for i, m in enumerate(matchers):
        finite = set(torch.isfinite(fast[i]).nonzero().flatten().tolist())
        assert finite == (set(range(vocab_size)) if m is None else allowed_ids(m))
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    assert torch.isinf(fast[constrained, len(tokenizer):]).all()  # the padding of the vocabulary
    assert apply_grammar_masks(logits, [None] * len(matchers)) is logits
    # The unpacking against numpy's, bit for bit, on random words (every bit pattern and sign).
    words = torch.randint(-2**31, 2**31, (3, bitmask_words(vocab_size)), dtype=torch.int64).to(torch.int32)
    bits = np.unpackbits(words.numpy().astype("<i4").view(np.uint8), bitorder="little").reshape(3, -1)
    assert torch.equal(unpack_bitmask(words, vocab_size), torch.from_numpy(bits[:, :vocab_size].astype(bool)))
    half = apply_grammar_masks(logits.to(torch.bfloat16), matchers)
    assert half.dtype == torch.bfloat16 and torch.equal(torch.isinf(half), torch.isinf(fast))


@pytest.mark.parametrize("params, fragment", [
    (StructuredOutputsParams(json=json.dumps({"type": "frobnicate"})), "json"),
    (StructuredOutputsParams(json=json.dumps({"properties": {"a": {"$ref": "#/" + "x" * 5000}}})), "json"),
    (StructuredOutputsParams(regex="[a-"), "regex"),
    (StructuredOutputsParams(regex="(a)\\1"), "regex"),
])
def test_invalid_specs_raise_a_short_value_error(params, fragment, compiler):
    with pytest.raises(ValueError) as info:
        compiler.compile(params)
    message = str(info.value)
    assert fragment in message and len(message) < 300 and "\n" not in message and ".cc:" not in message


def test_compiled_grammars_are_cached_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first_a, first_b = compiler.compile(a), compiler.compile(b)
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first_a  # a hit: b is now the least recent
    compiler.compile(c)  # drops b
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not first_b


def test_compiles_from_several_threads_at_once(compiler, tokenizer):
    params = [StructuredOutputsParams(regex=f"[a-z]{{{n}}}x") for n in range(1, 9)]
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.compile, params))
    for n, grammar in enumerate(grammars, start=1):
        assert GrammarMatcher.from_tokens(grammar, tokenizer.encode("q" * n + "x")).is_terminated
