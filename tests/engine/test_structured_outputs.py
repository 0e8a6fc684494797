"""Structured outputs on one engine, the real default model: every completion, greedy or
sampled, parses and validates (jsonschema, Python's re: independent of the grammar library),
and a constrained row never slows or changes its unconstrained neighbours."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_checks import assert_all_blocks_free

from tandem import SamplingParams
from tandem.decoding.grammar import GrammarMatcher, new_bitmask
from tandem.decoding.grammar_mask import unpack_bitmask
from tandem.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]},
}, "required": ["name", "age", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def _prompt(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_greedy_and_sampled_validate(llm):
    prompt = _prompt(llm, "Describe a person as JSON with name, age and favourite colour.")
    constraint = StructuredOutputsParams(json=json.dumps(PERSON))
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint))[0]
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=80,
                                                  structured_outputs=constraint))[0]
    for completion in [greedy.outputs[0], *sampled.outputs]:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert_all_blocks_free(llm)


def test_json_object_regex_and_choice(llm):
    prompt = _prompt(llm, 'Return a JSON object with keys "name" and "age" for Alice, 30.')
    cases = [
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
         lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
        (StructuredOutputsParams(choice=("yes", "no", "maybe not")), lambda text: text in ("yes", "no", "maybe not")),
    ]
    # Greedy, then sampled. (A prompt the 135M model answers briefly: asked for JSON on
    # something vaguer, it can nest objects past any max_tokens.)
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=c) for c, _ in cases]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=c)
               for i, (c, _) in enumerate(cases * 3)]
    outputs = llm.generate([prompt] * len(params), params)
    for out, (_, valid) in zip(outputs, cases * 4):
        assert out.finish_reason == "stop" and valid(out.text), out.text
    assert_all_blocks_free(llm)


def test_unconstrained_neighbours_are_unchanged(llm):
    prompt = _prompt(llm, "Name three fruits.")
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(prompt, plain)[0].token_ids
    both = llm.generate([prompt, prompt], [plain, SamplingParams(temperature=0, max_tokens=12, structured_outputs=
                                                                 StructuredOutputsParams(regex="[A-Z]+"))])
    assert both[0].token_ids == alone
    assert re.fullmatch("[A-Z]+", both[1].text)


def test_an_invalid_constraint_is_refused_before_it_runs(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(_prompt(llm, "hi"), SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_the_processors_leave_nothing_of_ends_with_abort(llm, temperature):
    """Defect 6: min_tokens masks the stop token ids, here every token the choice allows first,
    so the sampler can only pick a token the grammar refuses. That token is never emitted: the
    request ends "abort" (the constraint could not be met) with its output a valid prefix."""
    choice = StructuredOutputsParams(choice=("yes", "no"))
    grammar = llm.engine.grammars.compile(choice)
    bitmask = new_bitmask(1, grammar.vocab_size)
    GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    allowed = unpack_bitmask(bitmask, grammar.vocab_size)[0].nonzero().flatten().tolist()
    assert 1 < len(allowed) < 100, allowed  # the prefixes of "yes" and "no"
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=20, min_tokens=5, stop_token_ids=allowed,
                            structured_outputs=choice)
    out = llm.generate(_prompt(llm, "Is the sky blue? Answer yes or no."), params)[0]
    assert out.finish_reason == "abort", (out.text, out.token_ids, out.finish_reason)
    assert (out.text, out.token_ids) == ("", [])  # nothing refused was emitted: the empty prefix
    assert_all_blocks_free(llm)
