"""Prefill packing on the real model: short prompts that start beside a long one's capped
chunks, the long one's refilled chunks, a second long one starting on the first one's last
step and a prefix-cache hit all keep greedy output token-exact against transformers."""

from __future__ import annotations

import pytest
from engine_checks import assert_all_blocks_free
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 12
BUDGET = 64
# (name, prompt length, skip into the reference text, max new tokens, step it arrives before)
REQUESTS = (("long", 400, 0, 12, 0), ("short-a", 9, 500, 10, 0), ("short-b", 23, 600, 8, 0),
            ("long-2", 150, 700, 9, 0), ("short-c", 17, 900, 10, 1), ("short-d", 20, 1000, 8, 3))


def test_packed_prefill_keeps_outputs_exact(make_llm, hf_model, loaded, tokenizer):
    """Budget 64 (threshold 32): the short prompts start while the long one is chunked, and
    every output equals transformers' greedy one, as does a prompt sharing the long one's
    first 240 tokens that arrives mid-way (a prefix-cache hit)."""
    prompts = {name: english_token_ids(tokenizer, n, skip=skip) for name, n, skip, _, _ in REQUESTS}
    prompts["follow"] = prompts["long"][:240] + english_token_ids(tokenizer, 7, skip=1200)
    max_tokens = {name: m for name, _, _, m, _ in REQUESTS} | {"follow": 6}
    arrivals = {name: step for name, _, _, _, step in REQUESTS} | {"follow": 6}
    llm = make_llm(block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET)
    assert llm.config.long_prefill_token_threshold == BUDGET // 2
    engine, sched = llm.engine, llm.engine.scheduler
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    seqs = {}
    shorts_beside_long_chunks = 0
    step = 0
    while step == 0 or engine.has_unfinished:
        for name in [n for n, s in arrivals.items() if s == step]:
            engine.add_request(name, prompts[name], SamplingParams(temperature=0, max_tokens=max_tokens[name]))
            seqs[name] = sched.waiting[-1]
        batch = sched.schedule()
        assert batch.num_tokens <= BUDGET
        chunked = [s.request_id for i, s in enumerate(batch.seqs) if not batch.samples(i)]
        starting_shorts = [s.request_id for i, s in enumerate(batch.seqs)
                           if s.request_id.startswith("short") and batch.num_new_tokens[i] > 1]
        shorts_beside_long_chunks += bool("long" in chunked and starting_shorts)
        for u in sched.update(batch, engine.runner.run(batch)):
            tokens[u.seq.request_id] += u.new_token_ids
            if u.seq.status.is_finished:
                del engine.sequences[u.seq.request_id]
        step += 1
    assert shorts_beside_long_chunks >= 2, "short prompts never started beside the long one's chunks"
    assert seqs["follow"].num_cached_prompt_tokens == 240
    eos = loaded.config.eos_token_ids
    for name, prompt in prompts.items():
        assert tokens[name] == hf_greedy(hf_model, prompt, max_tokens[name], eos), name
    assert_all_blocks_free(llm)
