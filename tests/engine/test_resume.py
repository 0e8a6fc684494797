"""A request resumed mid-stream (WorkerRequest.num_resumed_tokens: prompt plus the output the
client already has) goes on exactly as the uninterrupted request would have, the real default
model: tokens, text after the cut (stop strings held back alike), log-probabilities, usage,
greedy and seeded sampling alike, with penalties, min_tokens and a JSON schema; a completion of
an n=2 request resumes as its own n=1 request with the seed it draws from (seed + index)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from engine_checks import assert_all_blocks_free

from tandem import SamplingParams
from tandem.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(enable_prefix_caching=True)


def run(llm, request_id: str, prompt: list[int], params: SamplingParams, num_resumed_tokens: int = 0) -> dict:
    """One request's deltas joined per completion: tokens, text, logprobs, the last delta."""
    llm.engine.add_request(request_id, prompt, params, num_resumed_tokens=num_resumed_tokens)
    out: dict = {}
    while llm.engine.has_unfinished:
        for d in llm.engine.step():
            c = out.setdefault(d.index, {"tokens": [], "texts": [], "logprobs": []})
            c["tokens"] += d.new_token_ids
            c["texts"].append(d.new_text)
            c["logprobs"] += d.new_logprobs or []
            c["last"] = d
    return out


def texts_after(texts: list[str], tokens_per_delta: list[int], num_tokens: int) -> str:
    """The text the deltas released after the first ``num_tokens`` tokens had gone out."""
    seen, cut = 0, 0
    for i, n in enumerate(tokens_per_delta):
        if seen >= num_tokens:
            break
        seen += n
        cut = i + 1
    assert seen == num_tokens  # cuts fall between deltas (one token a step here)
    return "".join(texts[cut:])


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, logprobs=0),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40, logprobs=0),
    "penalties": SamplingParams(temperature=0.8, seed=9, max_tokens=40, frequency_penalty=1.0,
                                presence_penalty=0.5, repetition_penalty=1.2, min_tokens=30),
    # (the greedy output's first "tapestry of" is held back until "France" follows; its second,
    # "tapestry of cultures", stops it)
    "stop": SamplingParams(temperature=0, max_tokens=60, stop=("tapestry of c", "Paris is")),
    "json": SamplingParams(temperature=0.7, seed=3, max_tokens=60,
                           structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
}


@pytest.mark.parametrize("case", CASES)
def test_resumed_request_goes_on_as_the_uninterrupted_one(llm, case):
    params = CASES[case]
    prompt = llm.apply_chat_template([{"role": "user", "content": "Tell me about France and its capital city."}])
    whole = run(llm, f"{case}-whole", prompt, params)[0]
    tokens = whole["tokens"]
    assert len(tokens) >= 8, whole
    per_delta = [1] * len(tokens)
    # cuts where the text so far is held back (a stop string's possible start) among them
    held = [i + 1 for i, text in enumerate(whole["texts"][:-1]) if not text]
    assert held or case != "stop", whole["texts"]
    for cut in sorted({1, len(tokens) // 2, len(tokens) - 1, *held}):
        resumed = run(llm, f"{case}-{cut}", prompt + tokens[:cut], params, num_resumed_tokens=cut)[0]
        assert tokens[:cut] + resumed["tokens"] == tokens, cut
        assert "".join(resumed["texts"]) == texts_after(whole["texts"], per_delta, cut), cut
        assert resumed["logprobs"] == pytest.approx(whole["logprobs"][cut:], abs=1e-4)
        last, whole_last = resumed["last"], whole["last"]
        assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == (
            whole_last.finish_reason, len(prompt), len(tokens))
    if case == "json":
        json.loads("".join(whole["texts"]))
    assert_all_blocks_free(llm)


def test_an_n2_completion_resumes_alone_with_its_own_seed(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=21, n=2, max_tokens=24)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    whole = run(llm, "n2-whole", prompt, params)
    assert whole[0]["tokens"] != whole[1]["tokens"]
    for index in (0, 1):
        tokens = whole[index]["tokens"]
        alone = dataclasses.replace(params, n=1, seed=params.seed + index)
        resumed = run(llm, f"n2-{index}", prompt + tokens[:10], alone, num_resumed_tokens=10)[0]
        assert tokens[:10] + resumed["tokens"] == tokens
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(("params", "num_resumed", "message"), [
    (SamplingParams(n=2, max_tokens=8), 2, "n=1"),
    (SamplingParams(max_tokens=4), 4, "max_tokens=4"),
    (SamplingParams(max_tokens=8), 9, "num_resumed_tokens must be"),
])
def test_a_resume_it_cannot_take_is_refused_holding_nothing(llm, params, num_resumed, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("refused", list(range(100, 109)), params, num_resumed_tokens=num_resumed)
    assert llm.engine.get_sequence("refused") is None
    assert_all_blocks_free(llm)
