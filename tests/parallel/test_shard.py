"""Cutting the model over tensor-parallel ranks: the exact ranges each rank holds, and the
ranks' forward (all-reduced between threads) equal to the whole model's in float64."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kvcache.block_manager import BlockManager
from tandem.model.llama import LlamaModel
from tandem.model.loader import weights_from_hf_model
from tandem.model.quantization import quantize_weights
from tandem.parallel.shard import even_split, rank_shards, shard_weights
from tandem.sampling_params import SamplingParams


def ranges(config, tp: int) -> list[tuple[int, int, int, int, int, int]]:
    return [(s.kv_head_start, s.num_kv_heads, s.head_start, s.num_heads, s.intermediate_start, s.intermediate_size)
            for s in rank_shards(config, tp)]


def test_even_split_gives_the_first_parts_the_extra_units():
    assert even_split(3, 2) == [(0, 2), (2, 1)]
    assert even_split(1536, 2, 128) == [(0, 768), (768, 768)]
    assert even_split(640, 3, 128) == [(0, 256), (256, 256), (512, 128)]
    with pytest.raises(ValueError):
        even_split(100, 2, 32)


def test_default_model_shards_exactly(loaded):
    """SmolLM2-135M: 9 query heads in 3 groups of 3 (3 KV heads), MLP 1536."""
    config = loaded.config
    assert ranges(config, 1) == [(0, 3, 0, 9, 0, 1536)]
    # 3 KV heads over 2 ranks: 2 + 1, their query heads with them.
    assert ranges(config, 2) == [(0, 2, 0, 6, 0, 768), (2, 1, 6, 3, 768, 768)]
    assert ranges(config, 3) == [(0, 1, 0, 3, 0, 512), (1, 1, 3, 3, 512, 512), (2, 1, 6, 3, 1024, 512)]
    # More ranks than KV heads: each KV head on 2 ranks, which split its 3 query heads 2 + 1.
    assert ranges(config, 6) == [(0, 1, 0, 2, 0, 256), (0, 1, 2, 1, 256, 256), (1, 1, 3, 2, 512, 256),
                                 (1, 1, 5, 1, 768, 256), (2, 1, 6, 2, 1024, 256), (2, 1, 8, 1, 1280, 256)]
    for tp in (4, 5, 12):  # not a multiple of the KV heads, or more replicas than query heads per group
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            rank_shards(config, tp)


def test_shard_weights_cut_the_fused_projections_at_the_rank_heads(loaded):
    config, w = loaded.config, loaded.weights
    d, h, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    shard = rank_shards(config, 2)[1]  # query heads 6..8, KV head 2, MLP 768..1535
    part = shard_weights(w, config, shard).layers[0]
    full = w.layers[0]
    q, k, v = full.qkv_proj.split([h * d, hkv * d, hkv * d])
    assert isinstance(part.qkv_proj, torch.Tensor) and isinstance(part.o_proj, torch.Tensor)  # float weights
    assert isinstance(part.gate_up_proj, torch.Tensor) and isinstance(part.down_proj, torch.Tensor)
    assert torch.equal(part.qkv_proj, torch.cat([q[6 * d:9 * d], k[2 * d:3 * d], v[2 * d:3 * d]]))
    assert torch.equal(part.o_proj, full.o_proj[:, 6 * d:9 * d])
    gate, up = full.gate_up_proj.split([inter, inter])
    assert torch.equal(part.gate_up_proj, torch.cat([gate[768:], up[768:]]))
    assert torch.equal(part.down_proj, full.down_proj[:, 768:])


class ThreadAllReduce:
    """A sum across threads, one per rank (torch.distributed stands in for it between processes)."""

    def __init__(self, tp: int) -> None:
        self.barrier = threading.Barrier(tp)
        self.parts: list[torch.Tensor | None] = [None] * tp

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            parts = [p for p in self.parts if p is not None]
            assert len(parts) == len(self.parts)  # every rank's, after the barrier
            total = sum(parts)
            assert isinstance(total, torch.Tensor)
            self.barrier.wait()
            return t.copy_(total)
        return all_reduce


@pytest.fixture(scope="module")
def float64_weights(hf_model, loaded):
    return weights_from_hf_model(hf_model, loaded.config, torch.float64)


@pytest.mark.parametrize("tp", [2, 3, 6])
def test_ranks_forward_equals_the_whole_model_in_float64(loaded, float64_weights, tp):
    """A prefill of 40 tokens, then a decode step over the cache each rank filled with its heads."""
    config = EngineConfig.build(loaded.config, num_kv_blocks=8, dtype="float32")
    whole = LlamaModel(loaded.config, float64_weights, config.max_model_len)
    reduce = ThreadAllReduce(tp)
    parts = [LlamaModel(loaded.config, shard_weights(float64_weights, loaded.config, s), config.max_model_len,
                        s.num_heads, s.num_kv_heads, reduce.for_rank(s.rank)) for s in rank_shards(loaded.config, tp)]
    runners = [ModelRunner(config, m) for m in [whole, *parts]]
    for r in runners:
        r.kv_cache = r.kv_cache.double()
    seq = Sequence("r", list(range(1000, 1040)), SamplingParams(temperature=0), 0, None)
    BlockManager(8, config.block_size, False).allocate(seq, 41)
    for batch in (ScheduledBatch([seq], [40]), None):
        if batch is None:  # the decode step after the prompt
            seq.num_computed_tokens = 40
            seq.token_ids.append(2000)
            batch = ScheduledBatch([seq], [1])
        input_ids, positions, meta, logits_indices = runners[0].prepare(batch)
        outputs: list[torch.Tensor | None] = [None] * tp

        def run(rank: int) -> None:
            outputs[rank] = parts[rank].forward(input_ids, positions, runners[rank + 1].kv_cache, meta, logits_indices)

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expected = whole.forward(input_ids, positions, runners[0].kv_cache, meta, logits_indices)
        for out in outputs:
            assert out is not None
            # the logits come back in float32: equal to its rounding of the float64 sums
            assert torch.allclose(out, expected, rtol=0, atol=1e-5), (out - expected).abs().max()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_shard_along_their_channels(loaded, method):
    """A rank's quantized projections are exactly the whole quantized weight's rows (q/k/v,
    gate/up) and columns (o, down) at its heads, dequantized."""
    config = loaded.config
    d, h, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    layer = quantize_weights(dataclasses.replace(loaded.weights, layers=loaded.weights.layers[:1]), method).layers[0]
    shard = rank_shards(config, 2)[0]  # query heads 0..5, KV heads 0..1, MLP 0..767
    part = shard_weights(dataclasses.replace(loaded.weights, layers=[layer]), config, shard).layers[0]
    qkv = layer.qkv_proj.dequantize()
    q_rows, k_rows = qkv[:6 * d], qkv[h * d:(h + 2) * d]
    v_rows = qkv[(h + hkv) * d:(h + hkv + 2) * d]
    assert torch.equal(part.qkv_proj.dequantize(), torch.cat([q_rows, k_rows, v_rows]))
    assert torch.equal(part.o_proj.dequantize(), layer.o_proj.dequantize()[:, :6 * d])
    gate_up = layer.gate_up_proj.dequantize()
    assert torch.equal(part.gate_up_proj.dequantize(), torch.cat([gate_up[:768], gate_up[inter:inter + 768]]))
    assert torch.equal(part.down_proj.dequantize(), layer.down_proj.dequantize()[:, :768])
