"""--kv-cache-dtype bfloat16 on the default model as it serves (int4 weights from its GGUF file,
float32 activations): the pool, its swap space and its sizing in bfloat16, generation, and
swapping that brings a sequence's KV back exactly."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_checks import assert_all_blocks_free

from tandem import LLM, SamplingParams
from tandem.bench.kv_dtype import PARITY_PROMPTS, compare_kv_dtypes, default_model, report_lines
from tandem.config import gib_to_bytes
from tandem.kvcache.capacity import KVCapacity
from tandem.model.loader import LoadedModel

logger = logging.getLogger(__name__)

POOL_GIB = 0.05
FLOAT32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
"""SmolLM2-135M: 2 (K, V) x 30 layers x 3 KV heads x 64 head dim x 4 bytes."""


@pytest.fixture(scope="module")
def int4() -> tuple[LoadedModel, str | None]:
    """The default model as `LLM()` loads it: its GGUF file's own Q4_1 blocks, float32 activations."""
    loaded, fmt = default_model(None, "auto")
    assert fmt == "int4"
    return loaded, fmt


def _llm(int4: tuple[LoadedModel, str | None], **engine_args) -> LLM:
    loaded, fmt = int4
    return LLM.from_loaded(loaded, quantization=fmt, **engine_args)


def test_a_bf16_pool_under_float32_activations(int4):
    llm = _llm(int4, kv_cache_dtype="bfloat16", kv_cache_memory_gib=POOL_GIB, swap_space_gib=POOL_GIB / 2)
    config, runner = llm.config, llm.engine.runner
    assert (config.dtype_name, config.kv_cache_dtype_name, config.quantization) == ("float32", "bfloat16", "int4")
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.swapper.host_cache.dtype == torch.bfloat16
    # Sized by bfloat16's 2 bytes: half of float32's bytes per token, twice the blocks per GiB.
    capacity = KVCapacity.of_engine_config(config)
    assert capacity.bytes_per_token == FLOAT32_BYTES_PER_TOKEN // 2 == 23040
    assert config.num_kv_blocks == gib_to_bytes(POOL_GIB) // (16 * 23040) == 145
    assert config.num_swap_blocks == gib_to_bytes(POOL_GIB / 2) // (16 * 23040) == 72
    assert runner.kv_cache.nbytes == capacity.pool_bytes == 145 * 16 * 23040
    outputs = llm.generate(list(PARITY_PROMPTS[:3]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
    assert runner.kv_cache.abs().amax().item() > 0  # (the pool was written)
    assert_all_blocks_free(llm)


def test_bfloat16_named_on_the_int4_format_holds_twice_the_blocks(int4):
    """On the int4 format (float32 activations, on the CPU) auto keeps float32; bfloat16 named
    gives a pool of twice the blocks in the same memory."""
    config = _llm(int4, kv_cache_memory_gib=POOL_GIB).config
    assert (config.kv_cache_dtype_name, config.dtype_name) == ("float32", "float32")
    assert KVCapacity.of_engine_config(config).bytes_per_token == FLOAT32_BYTES_PER_TOKEN
    assert config.num_kv_blocks == gib_to_bytes(POOL_GIB) // (16 * FLOAT32_BYTES_PER_TOKEN) == 72
    config = _llm(int4, kv_cache_dtype="bfloat16", kv_cache_memory_gib=POOL_GIB).config
    assert (config.kv_cache_dtype_name, config.dtype_name) == ("bfloat16", "float32")
    assert config.num_kv_blocks == gib_to_bytes(POOL_GIB) // (16 * 23040) == 145


def test_swapping_a_bf16_pool_keeps_outputs_exact(int4):
    """A pool too small for the batch: sequences swap out to bfloat16 host blocks and back, and
    give the same tokens as in a pool that never preempts."""
    prompts = [{"prompt": p} for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = _llm(int4, kv_cache_dtype="bfloat16", kv_cache_memory_gib=POOL_GIB)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert roomy.engine.counters().num_preemptions == 0
    tight = _llm(int4, kv_cache_dtype="bfloat16", num_kv_blocks=14, num_swap_blocks=14, preemption_mode="swap",
                 enable_prefix_caching=False)
    outputs = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    counters = tight.engine.counters()
    assert counters.num_swapped_out_blocks == counters.num_swapped_in_blocks > 0
    assert outputs == expected
    assert_all_blocks_free(tight)


def test_greedy_agreement_of_bf16_and_float32_kv(int4):
    """Reported, not asserted equal (bfloat16 KV changes the numbers): the tokens equal until
    the first divergence on parity prompts. Only a gross fault (garbage read back) would put
    the mean below half."""
    loaded, fmt = int4
    assert loaded.tokenizer is not None
    prompts = [loaded.tokenizer.encode(p) for p in PARITY_PROMPTS]
    rows = compare_kv_dtypes(loaded, fmt, ["float32", "bfloat16"], prompts, max_tokens=24)
    for line in report_lines(rows):
        logger.info("%s", line)
    reference, bf16 = rows
    assert (reference.kv_cache_dtype, bf16.kv_cache_dtype) == ("float32", "bfloat16")
    assert reference.identical_share == 1.0 and bf16.bytes_per_token * 2 == reference.bytes_per_token
    assert bf16.mean_equal_prefix >= 12
