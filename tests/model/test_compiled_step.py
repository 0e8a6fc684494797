"""The compiled CPU decode step (tandem/model/compiled_step.py) computes what the eager forward
computes, to the bit: the same logits and the same K and V written into the cache, at batch
sizes across the GEMV kernels' row groups, with contexts long enough to be split and merged,
over a float32 and a bfloat16 cache; and the runner takes it for exactly the steps it runs.
(The eager forward is held to transformers' by tests/model and tests/kernels.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kernels import decode_step_cpu, int4_gemv_cpu, ops
from tandem.model.compiled_step import CompiledDecodeStep
from tandem.model.llama import LlamaModel, ModelWeights
from tandem.model.quantization import quantize_weights
from tandem.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 160

pytestmark = pytest.mark.skipif(decode_step_cpu.load_extension() is None, reason="needs a C++ compiler")


def make_runner(loaded, weights: ModelWeights, **engine_args: Any) -> ModelRunner:
    config = EngineConfig.build(loaded.config, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                num_kv_blocks=NUM_BLOCKS, max_model_len=2048, num_swap_blocks=8, **engine_args)
    return ModelRunner(config, LlamaModel(loaded.config, weights, 2048))


@pytest.fixture(scope="module")
def runner(loaded, int4_weights) -> ModelRunner:
    """The default model as its GGUF file serves it: int4 projections, an int8 LM head."""
    return make_runner(loaded, int4_weights)


def decode_args(r: ModelRunner, lengths: list[int]) -> tuple[Any, ...]:
    """The forward's arguments for one decode per length (the cache filled with noise first, so
    that attention reads real values)."""
    torch.manual_seed(0)
    r.kv_cache.normal_()
    seqs, next_block = [], 0
    for i, n in enumerate(lengths):
        s = Sequence(str(i), [(7 * i + 3 * t) % 1000 for t in range(n)], SamplingParams(temperature=0), i, None)
        num_blocks = -(-n // BLOCK_SIZE)
        s.block_ids = list(range(next_block, next_block + num_blocks))[::-1]  # out of order, as a pool hands them
        next_block += num_blocks
        s.num_computed_tokens = n - 1
        seqs.append(s)
    assert next_block <= NUM_BLOCKS
    input_ids, positions, meta, logits_indices = r.prepare(ScheduledBatch(seqs, [1] * len(seqs)))
    return input_ids, positions, meta, logits_indices


def both_ways(r: ModelRunner, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(eager logits, eager cache, compiled logits, compiled cache) from the same starting cache."""
    input_ids, positions, meta, logits_indices = args
    start = r.kv_cache.clone()
    eager = r.model.forward(input_ids, positions, r.kv_cache, meta, logits_indices)
    eager_cache = r.kv_cache.clone()
    r.kv_cache.copy_(start)
    assert r.compiled_step is not None and r.compiled_step.can_run(input_ids, meta)
    compiled = r.compiled_step.forward(input_ids, positions, r.kv_cache, meta, logits_indices)
    return eager, eager_cache, compiled, r.kv_cache.clone()


@pytest.mark.parametrize("lengths", [
    [9],                        # one row, one work item
    [700],                      # one row whose context is split over items and merged
    [5, 300, 17, 1000],         # splits and whole contexts together
    [40 + 37 * i for i in range(11)],  # two groups of rows in each product (8 + 3)
], ids=["1 short", "1 split", "4 mixed", "11 rows"])
def test_the_compiled_step_equals_the_eager_one_to_the_bit(runner, lengths: list[int]) -> None:
    eager, eager_cache, compiled, compiled_cache = both_ways(runner, decode_args(runner, lengths))
    assert compiled.shape == (len(lengths), runner.config.model.vocab_size) and compiled.dtype == torch.float32
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_cache, eager_cache)


def test_a_bfloat16_cache_and_an_int8_model_too(loaded) -> None:
    r = make_runner(loaded, quantize_weights(loaded.weights, "int8"))
    r.kv_cache = r.kv_cache.to(torch.bfloat16)
    eager, eager_cache, compiled, compiled_cache = both_ways(r, decode_args(r, [300, 20]))
    assert torch.equal(compiled, eager) and torch.equal(compiled_cache, eager_cache)


def test_int8_activations_too(loaded, runner) -> None:
    """With --activation-quantization int8 (on weights of their own: the choice is kept on their
    packs) both paths run the 8-bit products, to the same bits; where the CPU lacks AVX-512
    VNNI the engine refuses it as it starts."""
    if not int4_gemv_cpu.has_int8_dot():
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            make_runner(loaded, quantize_weights(loaded.weights, "int4"), activation_quantization="int8")
        return
    weights = quantize_weights(loaded.weights, "int4")
    r = make_runner(loaded, weights, activation_quantization="int8")
    assert all(vars(p)["gemv_pack"].int8_activations for p in (*[lw.down_proj for lw in weights.layers],
                                                               weights.lm_head))
    eager, eager_cache, compiled, compiled_cache = both_ways(r, decode_args(r, [300, 20, 9]))
    assert torch.equal(compiled, eager) and torch.equal(compiled_cache, eager_cache)
    # The runner's float32 activations, on the same values of weights: other products (the rounding;
    # its size: tests/kernels/test_int4_gemv_cpu.py per product, `tandem bench activations` in all).
    fixture_weights = runner.model.weights
    assert not any(vars(p)["gemv_pack"].int8_activations for p in (*[lw.down_proj for lw in fixture_weights.layers],
                                                                       fixture_weights.lm_head))
    assert not torch.equal(both_ways(runner, decode_args(runner, [300, 20, 9]))[2], compiled)


@pytest.mark.parametrize("lengths", [[9], [5, 300, 17, 1000, 40, 41, 42, 43]], ids=["1 short", "8 mixed"])
def test_float32_weights_too(loaded, lengths: list[int]) -> None:
    """The products of float32 weights are tandem's float32 kernel in both paths (f32_gemv_cpu)."""
    r = make_runner(loaded, loaded.weights)
    assert r.compiled_step is not None and r.compiled_step.max_tokens == 8
    eager, eager_cache, compiled, compiled_cache = both_ways(r, decode_args(r, lengths))
    assert torch.equal(compiled, eager) and torch.equal(compiled_cache, eager_cache)
    input_ids, positions, meta, _ = decode_args(r, [20] * 9)
    assert not r.compiled_step.can_run(input_ids, meta)  # 9 rows: F.linear's (sgemm) in the eager path


def test_the_runner_takes_it_for_decode_only_steps(runner, monkeypatch) -> None:
    calls: list[int] = []
    forward = CompiledDecodeStep.forward

    def counted(self, input_ids, *rest):  # noqa: ANN001, ANN202
        calls.append(input_ids.shape[0])
        return forward(self, input_ids, *rest)

    monkeypatch.setattr(CompiledDecodeStep, "forward", counted)
    decodes = [Sequence(str(i), list(range(30 + i)), SamplingParams(temperature=0), i, None) for i in range(2)]
    for i, s in enumerate(decodes):
        s.block_ids, s.num_computed_tokens = [2 * i, 2 * i + 1], s.num_tokens - 1
    prompt = Sequence("p", list(range(40)), SamplingParams(temperature=0), 9, None)
    prompt.block_ids = [150, 151, 152]
    runner.forward(ScheduledBatch(decodes, [1, 1]), None, None)
    assert calls == [2]
    runner.forward(ScheduledBatch([*decodes, prompt], [1, 1, 40]), None, None)  # a mixed step: eager
    runner.forward(ScheduledBatch(decodes, [1, 1]), lambda layer: None, None)  # a layer hook: eager
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")  # attention asked of torch: the eager path honours it
    runner.forward(ScheduledBatch(decodes, [1, 1]), None, None)
    assert calls == [2]


def test_it_is_left_out_where_it_cannot_run(loaded, int4_weights, runner) -> None:
    assert make_runner(loaded, int4_weights, enforce_eager=True).compiled_step is None
    bf16_head = dataclasses.replace(loaded.weights, lm_head=loaded.weights.lm_head.bfloat16())
    assert make_runner(loaded, bf16_head).compiled_step is None  # a weight no CPU kernel takes
    assert CompiledDecodeStep.for_model(runner.model, tensor_parallel_size=2) is None


def test_a_slot_outside_the_cache_is_refused(runner) -> None:
    input_ids, positions, meta, logits_indices = decode_args(runner, [20])
    bad = dataclasses.replace(meta, slot_mapping=torch.tensor([NUM_BLOCKS * BLOCK_SIZE]))
    with pytest.raises(RuntimeError, match="slot or context out of the cache"):
        runner.compiled_step.forward(input_ids, positions, runner.kv_cache, bad, logits_indices)
