"""Decode-only batches padded to static sizes (what CUDA graphs need, on by default on CUDA),
run here on the CPU: the padding rows write only the scratch block, and greedy output stays
token-exact with transformers."""

from __future__ import annotations

from reference import english_token_ids, hf_greedy

from tandem.config import EngineConfig
from tandem.engine.cuda_graphs import padded_decode_size
from tandem.engine.engine import LLMEngine
from tandem.engine.model_runner import ModelRunner
from tandem.model.llama import LlamaModel
from tandem.sampling_params import SamplingParams


def test_bucket_sizes() -> None:
    assert [padded_decode_size(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16, 24, 40]


def test_padded_decode_matches_transformers(loaded, hf_model, tokenizer) -> None:
    config = EngineConfig.build(loaded.config, num_kv_blocks=64, max_model_len=256)
    model = LlamaModel(loaded.config, loaded.weights, config.max_model_len)
    runner = ModelRunner(config, model, pad_decode=True)
    assert runner.kv_cache.shape[2] == config.num_kv_blocks + 1  # the scratch block
    scratch = runner.kv_cache[:, :, runner.scratch_block_id]
    assert not scratch.any()
    engine = LLMEngine(config, model, tokenizer, runner=runner)
    # 5 prompts decode as a batch of 5 padded to 8 (and fewer, padded to 4, 2, 1, as they end).
    prompts = [english_token_ids(tokenizer, 7 + 5 * i, skip=40 * i) for i in range(5)]
    max_tokens = [12, 9, 6, 4, 3]
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(5)}
    while engine.has_unfinished:
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    eos = loaded.config.eos_token_ids
    assert [outputs[str(i)] for i in range(5)] == [hf_greedy(hf_model, p, n, eos) for p, n in zip(prompts, max_tokens)]
    assert scratch.any()  # the padding rows ran, writing there alone
    assert engine.block_manager.num_free_blocks == config.num_kv_blocks
