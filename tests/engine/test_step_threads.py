"""A served worker's steps: small ones leave a core to the serving path, large ones take every
thread; the thread count never changes what is computed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reference import english_token_ids, hf_greedy

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.step_threads import MAX_SMALL_STEP_TOKENS, StepThreads
from tandem.model.llama import LlamaModel
from tandem.sampling_params import SamplingParams


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_small_steps_leave_a_core() -> None:
    assert StepThreads.for_served_worker(1) is None
    policy = StepThreads.for_served_worker(4)
    assert policy == StepThreads(4, 3, MAX_SMALL_STEP_TOKENS)
    assert [policy.for_step(n) for n in (1, MAX_SMALL_STEP_TOKENS, MAX_SMALL_STEP_TOKENS + 1, 512)] == [3, 3, 4, 4]


def test_an_engine_steps_on_the_policys_threads(loaded, hf_model, tokenizer, restore_threads) -> None:
    config = EngineConfig.build(loaded.config, num_kv_blocks=64, max_model_len=256)
    model = LlamaModel(loaded.config, loaded.weights, config.max_model_len)
    engine = LLMEngine(config, model, tokenizer, step_threads=StepThreads(3, 2))
    prompts = [english_token_ids(tokenizer, 9 + 4 * i, skip=30 * i) for i in range(2)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6))
    outputs: dict[str, list[int]] = {"0": [], "1": []}
    seen_threads: list[int] = []
    while engine.has_unfinished:
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        seen_threads.append(torch.get_num_threads())
    # The prompts' step (22 tokens) ran on 3 threads, the decodes of 2 sequences on 2.
    assert seen_threads[0] == 3 and set(seen_threads[1:]) == {2}
    eos = loaded.config.eos_token_ids
    assert [outputs["0"], outputs["1"]] == [hf_greedy(hf_model, p, 6, eos) for p in prompts]
