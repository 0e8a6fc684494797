"""Speculative decoding by prompt lookup, end to end on the real model: greedy output is
token-exact against transformers, sampled output keeps its distribution, blocks all free."""

from __future__ import annotations

import pytest
from engine_checks import assert_all_blocks_free
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 12


def test_greedy_with_speculation_matches_transformers(make_llm, hf_model, loaded, tokenizer):
    """A prompt that repeats a passage (drafts accepted) beside plain text (drafts mostly
    rejected), in one batch: the output is transformers' greedy output either way."""
    passage = english_token_ids(tokenizer, 60, skip=200)
    prompts = [passage + passage + passage[:10], english_token_ids(tokenizer, 45, skip=900)]
    max_new_tokens = [40, 25]
    llm = make_llm(block_size=BLOCK_SIZE, num_speculative_tokens=4, prompt_lookup_min=1)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_new_tokens])
    eos = loaded.config.eos_token_ids
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, n, eos) for p, n in zip(prompts, max_new_tokens)]
    spec = llm.engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert_all_blocks_free(llm)


def test_sampled_distribution_is_unchanged_by_speculation(make_llm, tokenizer):
    """Many seeds on a repetitive prompt: the second and third output tokens (the ones
    verified as drafts) are distributed alike with and without speculation."""
    prompt = tokenizer.encode("one two three four one two three four one two three four one two")
    # Seeds 0 to 299: six requests of n = 50 (completion i of a request seeded s draws as
    # seed s + i alone would), so the prompt is prefilled six times, not 300.
    num_seeds, n = 300, 50
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=3, seed=s, n=n, ignore_eos=True)
              for s in range(0, num_seeds, n)]
    llms = [make_llm(num_speculative_tokens=k, prompt_lookup_min=1) for k in (0, 3)]
    samples = [[tuple(c.token_ids[1:]) for o in llm.generate([prompt] * len(params), params) for c in o.outputs]
               for llm in llms]
    assert [len(s) for s in samples] == [num_seeds, num_seeds]
    spec = llms[1].engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for position in (0, 1):
        tv = _total_variation([s[position] for s in samples[0]], [s[position] for s in samples[1]])
        # top_k=4 keeps the categories few, so two samples of 300 from one distribution
        # differ little; a draft kept too often (or never) moves far more mass.
        assert tv < 0.15, (position, tv)
    for llm in llms:
        assert_all_blocks_free(llm)


def _total_variation(a: list[int], b: list[int]) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.count(k) / len(a) - b.count(k) / len(b)) for k in keys)
