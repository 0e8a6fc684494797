"""The Python API on the real model: prompts of every kind, streaming, chat, seeds,
stop strings, logprobs, aborts and clear errors."""

from __future__ import annotations

import random

import pytest
import torch
from engine_checks import assert_all_blocks_free
from reference import english_token_ids

from tandem import FinishReason, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_text_token_ids_and_dict_prompts_agree(llm, tokenizer):
    text = "The three primary colours are"
    ids = tokenizer.encode(text)
    by_text, by_ids, by_dict = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY)
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids == by_dict.token_ids
    assert by_text.text == tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.num_prompt_tokens == len(ids) and by_text.num_output_tokens == 12
    assert by_text.finish_reason == FinishReason.LENGTH


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == FinishReason.STOP  # ended by <|im_end|>, the EOS


def test_stream_deltas_add_up_to_generate(llm):
    prompt = "Write a short poem about the sea."
    whole = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=25))[0]
    deltas = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=25)))
    assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
    assert "".join(d.new_text for d in deltas) == whole.text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == whole.finish_reason


def test_closing_a_stream_aborts_and_frees_blocks(llm):
    stream = llm.stream("Count from one to one hundred:", SamplingParams(temperature=0, max_tokens=100))
    next(stream), next(stream)
    assert llm.engine.block_manager.num_used_blocks > 0
    stream.close()
    assert_all_blocks_free(llm)


def test_seeded_sampling_repeats_whatever_else_is_in_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234)
    alone = llm.generate("Once upon a time", params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=m, seed=None) for m in (5, 30, 17)]
    batch = llm.generate(["Hi", "Once upon a time", "List some fruits:", "Why?"], [others[0], params, *others[1:]])
    assert batch[1].token_ids == alone
    different_seed = llm.generate("Once upon a time",
                                  SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=99))
    assert different_seed[0].token_ids != alone  # the seed matters


def test_the_engine_seed_repeats_unseeded_sampling_across_engines(make_llm):
    """--seed / LLM(seed=...) (vLLM's): two engines started with one seed sample the same
    unseeded tokens; another seed samples others."""
    params = SamplingParams(temperature=1.0, max_tokens=20)

    def sampled(seed: int) -> list[int]:
        return make_llm(seed=seed).generate("Once upon a time", params)[0].token_ids

    first = sampled(5)
    assert sampled(5) == first and sampled(6) != first


def test_stop_string_ends_the_text_before_it(llm):
    prompt = "The alphabet begins: A, B, C,"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    stop = full[8:11]
    assert len(stop) == 3 and full.index(stop) == 8, f"pick a stop string that occurs once early: {full!r}"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert out.text == full[:8]
    assert out.finish_reason == FinishReason.STOP


def test_stop_token_id_ends_generation(llm, tokenizer):
    full = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_id = full.token_ids[3]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert out.finish_reason == FinishReason.STOP


def test_logprobs_match_transformers(llm, hf_model, tokenizer):
    prompt_ids = english_token_ids(tokenizer, 40)
    out = llm.generate(prompt_ids, SamplingParams(temperature=0.7, max_tokens=10, seed=7, logprobs=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 10
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + out.token_ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1]
    expected = reference.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=1e-3, rtol=0)


def test_random_aborts_leave_every_block_free(make_llm, tokenizer):
    """Requests aborted at random points (waiting, mid-prefill, decoding) free all blocks."""
    llm = make_llm(block_size=8, num_kv_blocks=200, max_num_batched_tokens=48)
    engine, bm = llm.engine, llm.engine.block_manager
    rng = random.Random(0)
    shared = english_token_ids(tokenizer, 40)
    for i in range(24):
        prompt = shared + english_token_ids(tokenizer, rng.randint(1, 150), skip=50 + 10 * i)
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 40)))
    while engine.has_unfinished:
        for request_id in list(engine.sequences):
            if rng.random() < 0.04:
                assert engine.abort_request(request_id).finish_reason == FinishReason.ABORT
        engine.step()
        # No block is in two tables unless shared, and then its count says so.
        holders: dict[int, int] = {}
        for seq in engine.scheduler.running:
            for b in seq.block_ids:
                holders[b] = holders.get(b, 0) + 1
        assert all(bm.ref_counts[b] == n for b, n in holders.items())
        assert bm.num_used_blocks == len(holders)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("bad_prompt, message", [
    ([], "empty"),
    ([1, 2, 10**6], "token ids"),
    ("x " * 3000, "max_model_len"),
])
def test_bad_prompts_are_refused_before_any_work(make_llm, bad_prompt, message):
    llm = make_llm(max_model_len=2048)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", bad_prompt], GREEDY)
    assert_all_blocks_free(llm)  # the good prompt was not queued either


def test_prompt_larger_than_the_pool_is_refused_at_once(make_llm):
    llm = make_llm(block_size=16, num_kv_blocks=4)
    with pytest.raises(ValueError, match="could never fit in the KV pool"):
        llm.generate([list(range(100, 200))], GREEDY)


def test_generation_stops_at_max_model_len(make_llm):
    llm = make_llm(max_model_len=20)
    out = llm.generate([list(range(100, 115))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.num_output_tokens == 5 and out.finish_reason == FinishReason.LENGTH


def test_bad_engine_arguments_name_the_field(make_llm):
    with pytest.raises(ValueError, match="block_size"):
        make_llm(block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        make_llm(dtype="int3")
