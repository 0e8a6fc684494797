"""The decode graphs' static buffers and output on fake CUDA (tests/device/fake_cuda.py): the
capture at start puts every buffer on the device at its bucket's shapes, and a replayed step's
logits come back there, with nothing crossing to the host (the real graphs' capture and timing:
``tandem bench gpu``)."""

from __future__ import annotations

from fake_cuda import CUDA, SMOLLM2, runner, seq
from fake_cuda_graphs import FakeGraphDevice

from tandem.engine.scheduler import ScheduledBatch


def test_buffers_and_logits_on_the_device(fake_cuda) -> None:
    device = FakeGraphDevice()
    r = runner(graph_device=device, max_num_seqs=4)
    assert r.graphs is not None and sorted(r.graphs.graphs) == [1, 2, 4]
    width = 1024 // 16  # max_model_len / block_size
    for size, inputs in r.graphs.inputs.items():
        assert all(t.device == CUDA for t in inputs.tensors)
        assert inputs.block_tables.shape == (size, width) and inputs.input_ids.shape == (size,)
        assert inputs.meta.max_decode_context_len == 1024 and inputs.meta.num_decode_tokens == size
    assert r.graphs.out.device == CUDA and r.graphs.out.shape == (4, SMOLLM2.vocab_size)
    logits = r.forward(ScheduledBatch([seq(i, 20 + 13 * i, 19 + 13 * i) for i in range(3)], [1] * 3), None, None)
    assert len(device.replays) == 1 and device.replays[0] is r.graphs.graphs[4]
    assert logits.device == CUDA and logits.shape == (3, SMOLLM2.vocab_size)
