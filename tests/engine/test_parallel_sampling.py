"""n > 1 completions per prompt: shared prompt blocks (copy-on-write), and each completion
equal to the request with its seed alone."""

from __future__ import annotations

import pytest
from reference import english_token_ids

from tandem import SamplingParams


def _peak_blocks(llm, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[int, dict]:
    """Run requests together on a fresh engine; -> (most blocks in use after any step, outputs)."""
    engine, bm = llm.engine, llm.engine.block_manager
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    peak = 0
    outputs: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished:
        for d in engine.step():
            outputs.setdefault((d.request_id, d.index), []).extend(d.new_token_ids)
        peak = max(peak, bm.num_used_blocks)
    assert bm.num_free_blocks == bm.num_blocks
    return peak, outputs


def test_eight_completions_share_the_prompt_and_each_equals_its_seed_alone(make_llm, tokenizer):
    # No prefix caching: the 8 separate requests then hold 8 copies of the prompt, as vLLM's
    # would when they arrive together; the n=8 request holds one.
    prompt = english_token_ids(tokenizer, 150)  # 10 blocks, the last one partly filled
    sampled = dict(temperature=0.9, max_tokens=12, ignore_eos=True)
    grouped, together = _peak_blocks(make_llm(num_kv_blocks=160, enable_prefix_caching=False),
                                     [("n8", prompt, SamplingParams(n=8, seed=100, **sampled))])
    separate, alone = _peak_blocks(make_llm(num_kv_blocks=160, enable_prefix_caching=False),
                                   [(f"s{i}", prompt, SamplingParams(seed=100 + i, **sampled)) for i in range(8)])
    # 10 shared prompt blocks + a copy of the partly filled last one for 7 of the completions
    # (the last holder writes it in place); the separate requests hold 8 x 10.
    assert grouped == 10 + 7 and separate == 8 * 10
    assert sorted(together) == [("n8", i) for i in range(8)]
    for i in range(8):
        assert together[("n8", i)] == alone[(f"s{i}", 0)], i
    assert len({tuple(t) for t in together.values()}) > 1  # they do differ from each other


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_completions_survive_preemption(make_llm, tokenizer, preemption_mode):
    """A pool too small for every completion to grow at once: the forks get preempted and
    resumed, and still give what they give alone on a roomy pool."""
    prompt = english_token_ids(tokenizer, 40, skip=300)
    params = SamplingParams(n=4, seed=7, temperature=0.8, max_tokens=40, ignore_eos=True)
    llm = make_llm(num_kv_blocks=12, preemption_mode=preemption_mode)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert llm.engine.counters().num_preemptions > 0
    roomy = make_llm(num_kv_blocks=160)
    for c in out.outputs:
        alone = roomy.generate({"prompt_token_ids": prompt},
                               SamplingParams(seed=7 + c.index, temperature=0.8, max_tokens=40, ignore_eos=True))[0]
        assert c.token_ids == alone.token_ids, c.index
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert out.num_output_tokens == 4 * 40
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("preemption_mode", ["swap", "auto"])
def test_forks_and_swaps_in_one_step_keep_every_completion(make_llm, tokenizer, preemption_mode):
    """Forked requests on an 8-block pool: a step swaps a sequence out and hands its freed
    blocks to another's copy-on-write in the same step (the swap-out must read them first)."""
    prompts = [english_token_ids(tokenizer, 20 + 3 * i, skip=60 + 97 * i) for i in range(4)]
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=40, ignore_eos=True) for i in range(4)]
    small = make_llm(num_kv_blocks=8, block_size=16, preemption_mode=preemption_mode, max_num_batched_tokens=256)
    got = small.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert small.engine.counters().num_swapped_out_blocks > 0
    expected = make_llm(num_kv_blocks=160).generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]


def test_every_completion_stops_on_its_own(make_llm):
    llm = make_llm(num_kv_blocks=64)
    params = SamplingParams(n=5, seed=3, temperature=1.0, max_tokens=30, stop=["."])
    out = llm.generate("Tell me about cats", params)[0]
    assert [c.index for c in out.outputs] == list(range(5)) and out.finished
    for c in out.outputs:
        assert c.finish_reason in ("stop", "length") and "." not in c.text


def test_abort_frees_every_completion(make_llm, tokenizer):
    llm = make_llm(num_kv_blocks=64)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("many", english_token_ids(tokenizer, 20), SamplingParams(n=6, seed=1, max_tokens=100))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 6
    delta = engine.abort_request("many")
    assert delta is not None and delta.finish_reason == "abort" and delta.request_finished
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished and not engine.sequences
