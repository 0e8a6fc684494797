"""The model's greedy output is unchanged when every attention kernel runs through Triton
(compiled on a GPU, Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
from engine_checks import assert_all_blocks_free
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams
from tandem.kernels.ops import BACKEND_ENV

pytestmark = pytest.mark.slow


def test_greedy_tokens_equal_transformers_through_triton(make_llm, hf_model, loaded, tokenizer, monkeypatch):
    """Chunked prefill (a 24-token step budget), a prefix-cache hit and batched decodes."""
    shared = english_token_ids(tokenizer, 40)
    prompts = [shared, shared + english_token_ids(tokenizer, 9, skip=300), english_token_ids(tokenizer, 7, skip=77)]
    max_tokens = 5
    eos = loaded.config.eos_token_ids
    expected = [hf_greedy(hf_model, p, max_tokens, eos) for p in prompts]

    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = make_llm(block_size=16, max_num_batched_tokens=24, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    first = llm.generate([prompts[0]], params)  # its blocks stay cached for the second prompt
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    assert rest[0].num_cached_tokens == 32  # two full 16-token blocks of the shared prompt
    assert_all_blocks_free(llm)
