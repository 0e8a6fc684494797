"""Beam search on the engine against transformers' own beam search on the default model."""

from __future__ import annotations

import pytest
from reference import english_token_ids, hf_beam_search

from tandem import SamplingParams

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_kv_blocks=96)


@pytest.mark.parametrize("beam_width,length_penalty,num_return", [(2, 1.0, 1), (4, 1.0, 3), (4, 0.5, 2)])
def test_beam_search_matches_transformers(llm, hf_model, tokenizer, beam_width, length_penalty, num_return):
    eos = llm.config.model.eos_token_ids
    params = SamplingParams(use_beam_search=True, beam_width=beam_width, length_penalty=length_penalty,
                            n=num_return, temperature=0, max_tokens=16)
    outputs = llm.generate(list(PROMPTS), params)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_beam_search(hf_model, tokenizer.encode(prompt), 16, eos, beam_width, length_penalty, num_return)
        assert [c.token_ids for c in out.outputs] == expected, prompt
        assert [c.index for c in out.outputs] == list(range(num_return))
        assert all(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out.outputs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_beam_search_with_an_early_end_matches_transformers(llm, hf_model, tokenizer):
    """A chat prompt whose best beams end with EOS well before max_tokens."""
    ids = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    eos = llm.config.model.eos_token_ids
    params = SamplingParams(use_beam_search=True, beam_width=3, n=3, temperature=0, max_tokens=24)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    expected = hf_beam_search(hf_model, ids, 24, eos, 3, 1.0, 3)
    assert [c.token_ids for c in out.outputs] == expected
    assert any(c.finish_reason == "stop" for c in out.outputs)


def test_beams_share_the_prompt_blocks(make_llm, tokenizer):
    """Four beams over a 6-block prompt hold far fewer blocks than four requests would."""
    llm = make_llm(num_kv_blocks=96, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    prompt = english_token_ids(tokenizer, 96)
    params = SamplingParams(use_beam_search=True, beam_width=4, temperature=0, max_tokens=10, ignore_eos=True)
    llm.engine.add_request("beams", prompt, params)
    peak = 0
    while llm.engine.has_unfinished:
        llm.engine.step()
        peak = max(peak, bm.num_used_blocks)
    # 6 full prompt blocks shared, and one block of its own per beam (4 separate sequences: 4 x 7).
    assert peak == 6 + 4
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_frees_every_beam(llm):
    bm = llm.engine.block_manager
    params = SamplingParams(use_beam_search=True, beam_width=4, temperature=0, max_tokens=50, ignore_eos=True)
    llm.engine.add_request("doomed", llm.tokenizer.encode(PROMPTS[0]), params)
    for _ in range(4):
        llm.engine.step()
    assert bm.num_used_blocks > 0
    delta = llm.engine.abort_request("doomed")
    assert delta is not None and delta.finish_reason == "abort" and delta.request_finished
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished and not llm.engine.sequences
