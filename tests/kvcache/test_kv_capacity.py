"""KVCapacity sizes a pool exactly as EngineConfig.build does, and the engine logs it at start."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import numpy as np
import pytest

from tandem.config import EngineConfig, ModelConfig, gib_to_bytes, kv_bytes_per_token, kv_heads_per_rank
from tandem.config.names import DTYPE_BYTES
from tandem.kvcache.capacity import KVCapacity
from tandem.model.dtypes import DTYPES

SMOLLM2 = ModelConfig(
    name="smollm2-shape", architecture="LlamaForCausalLM", num_layers=30, hidden_size=576,
    intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    attention_bias=False, tie_word_embeddings=True, max_position_embeddings=8192, sliding_window=None,
    eos_token_ids=(2,),
)
# A Mistral-like shape: 8 KV heads of 128, a sliding window below the context.
WINDOWED = dataclasses.replace(SMOLLM2, name="windowed", architecture="MistralForCausalLM", num_layers=32,
                               hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                               max_position_embeddings=32768, sliding_window=4096)


def capacity_for(model: ModelConfig, gib: float, block_size: int, dtype: str,
                 max_model_len: int | None) -> KVCapacity:
    limit = model.max_position_embeddings if max_model_len is None else min(model.max_position_embeddings,
                                                                          max_model_len)
    if model.sliding_window is not None:
        limit = min(limit, model.sliding_window)
    return KVCapacity.from_memory(
        gib_to_bytes(gib), block_size=block_size, dtype_bytes=DTYPE_BYTES[dtype], num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, max_model_len=limit,
    )


def test_dtype_bytes_are_the_engine_dtypes() -> None:
    assert DTYPE_BYTES == {name: dtype.itemsize for name, dtype in DTYPES.items()}


@pytest.mark.parametrize("model", [SMOLLM2, WINDOWED], ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_from_memory_sizes_the_pool_as_engine_config_build(model: ModelConfig, dtype: str) -> None:
    for gib in (0.01, 0.25, 1 / 3, 0.5, 1.0, 2.7, 12.0):
        for block_size in (1, 7, 16, 32):
            for max_model_len in (None, 100, 5000):
                try:
                    config = EngineConfig.build(model, dtype=dtype, block_size=block_size, kv_cache_memory_gib=gib,
                                                max_model_len=max_model_len, swap_space_gib=0)
                except ValueError:  # not one block: KVCapacity refuses it too
                    with pytest.raises(ValueError, match="hold no block"):
                        capacity_for(model, gib, block_size, dtype, max_model_len)
                    continue
                cap = capacity_for(model, gib, block_size, dtype, max_model_len)
                assert cap == KVCapacity.of_engine_config(config)
                assert cap.num_blocks == config.num_kv_blocks, (gib, block_size)
                assert cap.max_model_len == config.max_model_len
                assert cap.bytes_per_token == model.kv_bytes_per_token(DTYPES[dtype])
                # The formula again, in float64 from the seeds' terms.
                per_token = 2.0 * model.num_layers * model.num_kv_heads * model.head_dim * DTYPES[dtype].itemsize
                blocks = np.floor(np.float64(gib_to_bytes(gib)) / (np.float64(per_token) * block_size))
                assert cap.num_blocks == int(blocks)
                assert cap.num_tokens == cap.num_blocks * block_size
                assert cap.pool_bytes == cap.num_tokens * per_token <= gib * 2**30
                assert cap.max_concurrency == pytest.approx(np.float64(cap.num_tokens) / cap.max_model_len, rel=0)
                assert cap.max_full_length_seqs <= math.floor(cap.max_concurrency)


def test_full_length_sequences_count_whole_blocks() -> None:
    cap = KVCapacity(bytes_per_token=10, block_size=16, num_blocks=10, max_model_len=20)
    assert cap.max_concurrency == 8.0  # 160 tokens / 20
    assert cap.max_full_length_seqs == 5  # each takes 2 blocks of 16
    assert "5 sequences at full length" in cap.describe()


def test_tensor_parallel_splits_kv_heads_at_least_one_per_rank() -> None:
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert [kv_heads_per_rank(3, tp) for tp in (1, 2, 3, 4)] == [3, 2, 1, 1]  # uneven: the busiest rank
    assert kv_bytes_per_token(32, 8, 128, 2, tp=4) == 2 * 32 * 2 * 128 * 2
    gib = 4.0
    blocks = [KVCapacity.from_memory(gib_to_bytes(gib), block_size=16, dtype_bytes=2, num_layers=32, num_kv_heads=8,
                                     head_dim=128, max_model_len=4096, tp=tp).num_blocks for tp in (1, 2, 4, 8, 16)]
    assert blocks == [blocks[0], 2 * blocks[0], 4 * blocks[0], 8 * blocks[0], 8 * blocks[0]]
    with pytest.raises(ValueError):
        kv_heads_per_rank(8, 0)


def test_from_memory_refuses_a_pool_without_a_block() -> None:
    with pytest.raises(ValueError, match="hold no block"):
        KVCapacity.from_memory(1000, block_size=16, dtype_bytes=4, num_layers=30, num_kv_heads=3, head_dim=64,
                               max_model_len=8192)
    cap = KVCapacity.from_memory(16 * 46080, block_size=16, dtype_bytes=4, num_layers=30, num_kv_heads=3,
                                 head_dim=64, max_model_len=8192)
    assert (cap.num_blocks, cap.max_model_len, cap.max_concurrency) == (1, 16, 1.0)  # capped at the pool


LOG_LINE = re.compile(
    r"KV pool: (\d+) blocks of (\d+) tokens \((\d+) tokens, ([\d.]+) MiB, (\d+) bytes/token\); "
    r"max concurrency ([\d.]+)x at max_model_len (\d+) \((\d+) sequences? at full length\)$"
)


@pytest.mark.parametrize("engine_args", [{}, {"kv_cache_memory_gib": 0.1, "block_size": 32, "max_model_len": 1000}])
def test_engine_logs_its_kv_capacity(make_llm, caplog, engine_args: dict) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.engine.engine"):
        llm = make_llm(**engine_args)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.engine.engine" and "KV pool" in r.getMessage()]
    assert len(lines) == 1
    match = LOG_LINE.fullmatch(lines[0])
    assert match, lines[0]
    blocks, block_size, tokens, mib, per_token, concurrency, max_len, full = match.groups()
    config, kv_cache = llm.config, llm.engine.runner.kv_cache
    assert (int(blocks), int(block_size), int(max_len)) == (config.num_kv_blocks, config.block_size,
                                                            config.max_model_len)
    assert int(tokens) == config.num_kv_blocks * config.block_size
    assert int(per_token) == config.model.kv_bytes_per_token(config.dtype)
    assert mib == f"{kv_cache.numel() * kv_cache.element_size() / 2**20:.1f}"  # what was allocated
    assert concurrency == f"{int(tokens) / config.max_model_len:.2f}"
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    assert int(full) == config.num_kv_blocks // blocks_per_seq
    expected_blocks = gib_to_bytes(engine_args.get("kv_cache_memory_gib", 0.25)) // (
        config.block_size * int(per_token))
    assert int(blocks) == expected_blocks
