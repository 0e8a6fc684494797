"""Greedy output is token-exact against transformers' generate, whatever the engine does
to the batch: continuous batching, preemption, chunked prefill, prefix-cache hits."""

from __future__ import annotations

import pytest
from engine_checks import assert_all_blocks_free
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams

pytestmark = pytest.mark.slow

# 15 prompts from 1 to 1111 tokens; none is a multiple of the block size used (12).
PROMPT_LENGTHS = (1, 5, 13, 17, 25, 37, 50, 70, 101, 150, 223, 301, 410, 555, 1111)
MAX_NEW_TOKENS = (24, 8, 24, 31, 16, 24, 9, 24, 24, 20, 24, 13, 24, 17, 24)
BLOCK_SIZE = 12


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [english_token_ids(tokenizer, n, skip=37 * i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def expected(hf_model, loaded, prompts) -> list[list[int]]:
    eos = loaded.config.eos_token_ids
    return [hf_greedy(hf_model, p, n, eos) for p, n in zip(prompts, MAX_NEW_TOKENS)]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n) for n in MAX_NEW_TOKENS]


def test_one_batch_matches_transformers(make_llm, prompts, expected):
    """All 15 prompts in one continuous batch."""
    llm = make_llm(block_size=BLOCK_SIZE)
    outputs = llm.generate(prompts, greedy_params())
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason is not None for o in outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(make_llm, prompts, expected, preemption_mode):
    """A pool too small for the batch: sequences are preempted, recomputed or swapped out
    to host blocks and back, and unchanged (so both ways give the same tokens)."""
    llm = make_llm(block_size=BLOCK_SIZE, num_kv_blocks=130, enable_prefix_caching=False,
                   preemption_mode=preemption_mode)
    outputs = llm.generate(prompts, greedy_params())
    counters = llm.engine.counters()
    assert counters.num_preemptions > 0
    if preemption_mode == "swap":
        assert counters.num_swapped_out_blocks == counters.num_swapped_in_blocks > 0
    else:
        assert counters.num_swapped_out_blocks == 0
    assert [o.token_ids for o in outputs] == expected
    assert_all_blocks_free(llm)


def test_swapping_beside_prefix_cache_hits_keeps_outputs_exact(make_llm, hf_model, loaded, tokenizer):
    """Four prompts share a 300-token prefix in a pool that holds about two of them: swapped
    sequences leave the shared blocks to the others and come back unchanged."""
    prefix = english_token_ids(tokenizer, 300, skip=100)
    prompts = [prefix + english_token_ids(tokenizer, 20 + 7 * i, skip=500 + 50 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=60)
    llm = make_llm(block_size=BLOCK_SIZE, num_kv_blocks=40, max_num_batched_tokens=128, preemption_mode="swap")
    outputs = llm.generate(prompts, params)
    assert llm.engine.counters().num_swapped_out_blocks > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    eos = loaded.config.eos_token_ids
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, 60, eos) for p in prompts]
    assert_all_blocks_free(llm)


def test_chunked_prefill_keeps_outputs_exact(make_llm, prompts, expected):
    """A 64-token step budget: long prompts run in chunks, mixed with other sequences' decodes."""
    llm = make_llm(block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    mixed_steps = 0
    for i, (p, params) in enumerate(zip(prompts, greedy_params())):
        llm.engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while llm.engine.has_unfinished:
        batch = llm.engine.scheduler.schedule()
        assert batch.num_tokens <= 64
        mixed_steps += 1 in batch.num_new_tokens and any(n > 1 for n in batch.num_new_tokens)
        for u in llm.engine.scheduler.update(batch, llm.engine.runner.run(batch)):
            tokens[u.seq.request_id] += u.new_token_ids
            if u.seq.status.is_finished:
                del llm.engine.sequences[u.seq.request_id]
    assert mixed_steps > 0, "chunks never ran beside decodes"
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert_all_blocks_free(llm)


def test_whole_prompt_prefill_matches(make_llm, prompts, expected):
    """Chunked prefill off: every prompt is prefilled in one piece."""
    llm = make_llm(block_size=BLOCK_SIZE, enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert llm.config.max_num_batched_tokens >= max(PROMPT_LENGTHS)
    outputs = llm.generate(prompts, greedy_params())
    assert [o.token_ids for o in outputs] == expected


def test_prefix_cache_hit_reuses_blocks_and_keeps_output(make_llm, hf_model, loaded, tokenizer):
    """Two requests share a 600-token prefix: the second reuses its blocks, output unchanged."""
    prefix = english_token_ids(tokenizer, 600, skip=100)
    first = prefix + english_token_ids(tokenizer, 23, skip=900)
    second = prefix + english_token_ids(tokenizer, 41, skip=1000)
    params = SamplingParams(temperature=0, max_tokens=20)
    llm = make_llm(block_size=BLOCK_SIZE)
    out_first = llm.generate(first, params)[0]
    out_second = llm.generate(second, params)[0]
    assert out_first.num_cached_tokens == 0
    assert out_second.num_cached_tokens == (600 // BLOCK_SIZE) * BLOCK_SIZE
    eos = loaded.config.eos_token_ids
    assert out_first.token_ids == hf_greedy(hf_model, first, 20, eos)
    assert out_second.token_ids == hf_greedy(hf_model, second, 20, eos)
    # The same prompt again is served from the cache but for its last block.
    again = llm.generate(second, params)[0]
    assert again.num_cached_tokens == ((len(second) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert again.token_ids == out_second.token_ids
    assert_all_blocks_free(llm)
