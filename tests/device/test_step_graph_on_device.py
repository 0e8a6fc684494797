"""A decode step on fake CUDA (FakeTensorMode: no GPU needed) traces as one graph at the
default model's shapes, through the Triton path that a CUDA engine takes (the kernels behind
tandem's custom ops, kernels/triton_ops.py; their fake implementations give the shapes): the
int4 and int8 GEMVs, the KV store and attention, with nothing read back on the host. The CPU's
path: tests/model/test_step_graph.py, which also shows that a break fails the trace."""

from __future__ import annotations

import pytest
from fake_cuda import CUDA, SMOLLM2, runner, seq
from step_graph import StepGraphBroken, tandem_ops, trace_one_graph

from tandem.engine.scheduler import ScheduledBatch
from tandem.kernels import ops

TRITON_OPS = {"tandem.int4_gemv_triton", "tandem.int8_gemv_triton", "tandem.store_kv_triton",
              "tandem.attention_triton"}


@pytest.fixture
def triton_path(fake_cuda, monkeypatch) -> None:
    """The dispatch a CUDA engine gets (the fake_cuda fixture asks for torch's path)."""
    monkeypatch.setenv(ops.BACKEND_ENV, "auto")


def test_a_decode_step_is_one_graph_of_triton_ops(triton_path) -> None:
    r = runner("int4")  # int4 projections, an int8 LM head: the default GGUF file's formats
    input_ids, positions, meta, logits_indices = r.prepare(ScheduledBatch([seq(i, 20 + 13 * i, 19 + 13 * i)
                                                                           for i in range(3)], [1] * 3))
    assert input_ids.device == CUDA and input_ids.shape == (4,), "3 decodes padded to the bucket of 4"
    logits, gm = trace_one_graph(r.model.forward, input_ids, positions, r.kv_cache, meta, logits_indices)
    assert logits.device == CUDA and logits.shape == (3, SMOLLM2.vocab_size)
    ops_called = tandem_ops(gm)
    assert set(ops_called) == TRITON_OPS
    assert ops_called["tandem.attention_triton"] == ops_called["tandem.store_kv_triton"] == SMOLLM2.num_layers
    assert ops_called["tandem.int4_gemv_triton"] == 4 * SMOLLM2.num_layers
    assert ops_called["tandem.int8_gemv_triton"] == 1  # the LM head


def test_a_host_read_fails_the_trace(triton_path, monkeypatch) -> None:
    store_kv = ops.store_kv

    def reads_back(k, v, k_cache, v_cache, meta):  # noqa: ANN001, ANN202
        if meta.slot_mapping[0].item() < 0:  # a host read of a device value: a sync on a GPU
            raise AssertionError("unreachable")
        store_kv(k, v, k_cache, v_cache, meta)

    monkeypatch.setattr(ops, "store_kv", reads_back)
    r = runner()
    args = r.prepare(ScheduledBatch([seq(0, 20, 19)], [1]))
    with pytest.raises(StepGraphBroken, match="breaks the graph"):
        trace_one_graph(r.model.forward, args[0], args[1], r.kv_cache, args[2], args[3])
