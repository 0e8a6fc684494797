"""A decode step of the default model on the CPU traces as one graph (dynamo, fullgraph): every
compiled kernel it calls is a tandem custom op, and nothing in it reads a tensor back on the
host. The traced region is LlamaModel.forward given the step's prepared inputs
(ModelRunner.prepare builds them on the host first). The traced step computes the eager step's
logits exactly, and a host read or an opaque kernel call slipped into a layer fails the trace.
(Fake CUDA's Triton path: tests/device/test_step_graph_on_device.py.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from step_graph import StepGraphBroken, tandem_ops, trace_one_graph

from tandem.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.kernels import int4_gemv_cpu, layer_ops_cpu
from tandem.model.llama import LlamaModel
from tandem.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 64
CPU_OPS = {"tandem.rms_norm_cpu", "tandem.add_rms_norm_cpu", "tandem.rope_store_kv_cpu", "tandem.silu_mul_cpu",
           "tandem.paged_decode_attention_cpu", "tandem.int4_gemv_cpu", "tandem.int8_gemv_cpu"}


@pytest.fixture(scope="module")
def runner(loaded, int4_weights) -> ModelRunner:
    """The default model as the default GGUF file serves it (int4 projections, an int8 LM head),
    float32 on the CPU, decode batches padded to their buckets."""
    config = EngineConfig.build(loaded.config, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                num_kv_blocks=NUM_BLOCKS, max_model_len=1024, num_swap_blocks=8)
    model = LlamaModel(loaded.config, int4_weights, config.max_model_len)
    return ModelRunner(config, model, pad_decode=True)


def decode_inputs(r: ModelRunner, num_seqs: int) -> tuple[Any, ...]:
    """The forward's arguments for ``num_seqs`` decodes of different lengths (padded to the bucket)."""
    seqs = []
    for i in range(num_seqs):
        s = Sequence(str(i), [(7 * i + t) % 1000 for t in range(20 + 13 * i)], SamplingParams(temperature=0), i, None)
        s.block_ids = [(5 * i + b) % NUM_BLOCKS for b in range(-(-s.num_tokens // BLOCK_SIZE))]
        s.num_computed_tokens = s.num_tokens - 1
        seqs.append(s)
    input_ids, positions, meta, logits_indices = r.prepare(ScheduledBatch(seqs, [1] * num_seqs))
    return input_ids, positions, r.kv_cache, meta, logits_indices


def test_a_decode_step_is_one_graph_with_the_eager_logits(runner) -> None:
    args = decode_inputs(runner, 3)
    assert args[0].shape == (4,), "3 decodes padded to the bucket of 4"
    eager = runner.model.forward(*args)
    traced, gm = trace_one_graph(runner.model.forward, *args)
    ops = tandem_ops(gm)
    assert set(ops) == CPU_OPS
    num_layers = runner.config.model.num_layers
    assert (ops["tandem.paged_decode_attention_cpu"] == ops["tandem.rope_store_kv_cpu"] == ops["tandem.silu_mul_cpu"]
            == num_layers)
    assert ops["tandem.int4_gemv_cpu"] == 4 * num_layers and ops["tandem.int8_gemv_cpu"] == 1  # the LM head
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")  # the pybind call, on purpose
@pytest.mark.parametrize("patch, message", [
    ("a branch on a host read", "breaks the graph"),
    ("a host read passed on", "reads device values"),  # dynamo keeps .item() as a node: looked for
    ("a kernel without its op", "breaks the graph"),
])
def test_a_break_in_the_step_fails_the_trace(runner, monkeypatch, patch: str, message: str) -> None:
    add_rms_norm = layer_ops_cpu.add_rms_norm

    def branches(kernels, h, delta, weight, eps):  # noqa: ANN001, ANN202
        if delta[0, 0].item() > 1e30:  # a host read of a device value (a sync on a GPU)
            raise AssertionError("unreachable")
        return add_rms_norm(kernels, h, delta, weight, eps)

    def passes_on(kernels, h, delta, weight, eps):  # noqa: ANN001, ANN202
        return add_rms_norm(kernels, h, delta, weight, eps + 0.0 * delta[0, 0].item())

    def pybind_call(self, x2):  # noqa: ANN001, ANN202 - the kernel called as before it was an op
        return int4_gemv_cpu._module().int4_gemv(x2, self.values, self.scale_offset)

    if patch == "a kernel without its op":
        monkeypatch.setattr(int4_gemv_cpu.Int4GemvPack, "matmul", pybind_call)
    else:
        monkeypatch.setattr(layer_ops_cpu, "add_rms_norm", branches if patch.startswith("a branch") else passes_on)
    # The first two layers are enough (fullgraph stops at the first break; a host read kept in
    # the graph shows in the first layer) and trace in a fraction of the time.
    model = runner.model
    two_layers = LlamaModel(model.config, dataclasses.replace(model.weights, layers=model.weights.layers[:2]), 1024)
    with pytest.raises(StepGraphBroken, match=message):
        trace_one_graph(two_layers.forward, *decode_inputs(runner, 3))
