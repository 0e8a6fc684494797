"""The tensor-parallel step on fake CUDA (FakeTensorMode, no GPU needed), at the default
model's shapes with random weights: rank 0 builds the step message on the host, each rank
puts what its forward reads on its device in one transfer, and the step (KV writes, the
forward, the KV gather for sending, the all-reduces) produces device tensors only and reads
no device value back (FakeTensorMode raises on .item(), .tolist(), bool())."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from fake_cuda import BATCHES, BLOCK_SIZE, CUDA, SMOLLM2, DeviceAudit, random_weights

from tandem.config import EngineConfig
from tandem.kvcache.swap_copier import KVSwapper
from tandem.model.loader import LoadedModel
from tandem.parallel import runner as runner_module
from tandem.parallel.executor import DeviceCollectives, RankExecutor, rank_model
from tandem.parallel.runner import TensorParallelRunner
from tandem.parallel.step_message import ForwardInputs, KVWrites, StepMessage, StepOp, device_parts, on_device

TP = 2


class RecordingCollectives(DeviceCollectives):
    """The device group's collectives, recorded instead of run (NCCL needs GPUs)."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[tuple[str, torch.device]] = []

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self.devices.append(("all_reduce", t.device))
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        self.devices.append(("broadcast", t.device))

    def gather(self, t: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        self.devices += [("gather", x.device) for x in [t, *(parts or [])]]


def engine_config() -> EngineConfig:
    """A tp=2 engine on cuda:0 (built as cpu: this machine has no GPU to resolve cuda on)."""
    config = EngineConfig.build(SMOLLM2, device="cpu", dtype="bfloat16", block_size=BLOCK_SIZE, num_kv_blocks=64,
                                max_model_len=1024, tensor_parallel_size=TP)
    return dataclasses.replace(config, device_name=str(CUDA))


@pytest.fixture
def fake_ranks(fake_cuda, monkeypatch):
    """(rank 0's runner, rank 1's executor, each rank's collectives, the messages rank 0
    broadcast), on fake cuda."""
    config = engine_config()
    loaded = LoadedModel(SMOLLM2, random_weights(SMOLLM2, config.dtype), None)
    collectives = [RecordingCollectives() for _ in range(TP)]
    parts = [rank_model(loaded, TP, rank, config.max_model_len, collectives[rank], CUDA) for rank in range(TP)]
    runner = TensorParallelRunner(config, parts[0], collectives[0], None)
    kv_cache = torch.zeros(runner.kv_cache.shape[:4] + (parts[1].num_kv_heads, SMOLLM2.head_dim), dtype=config.dtype,
                           device=CUDA)
    other = RankExecutor(parts[1], kv_cache, KVSwapper(kv_cache, 0), TP, 1, collectives[1])
    sent: list[StepMessage] = []
    monkeypatch.setattr(runner_module, "broadcast_step", lambda msg, group: sent.append(msg))
    return runner, other, collectives, sent


@pytest.mark.parametrize("name", list(BATCHES))
def test_tp_step_runs_on_the_device_from_a_host_message(fake_ranks, name):
    runner, other, collectives, sent = fake_ranks
    batch = BATCHES[name][0]()
    send_slots = [s for q in batch.seqs for s in range(q.block_ids[0] * BLOCK_SIZE, q.block_ids[0] * BLOCK_SIZE + 3)]
    # KV another worker sent, as PendingKVWrites.take gives it (host tensors; its own host
    # work on real values is tests/parallel/test_kv_writes.py's): [2 rows, every KV head, head_dim]
    rows = torch.zeros(2, SMOLLM2.num_kv_heads, SMOLLM2.head_dim, dtype=torch.bfloat16)
    writes = KVWrites(torch.tensor([5, 9]), rows)
    runner.kv_writes = types.SimpleNamespace(take=lambda: writes)
    audit = DeviceAudit()
    with audit:
        logits = runner.forward(batch, None, send_slots)
        k, v = runner.gathered_rows(0, len(send_slots))
    (msg,) = sent
    assert msg.op is StepOp.FORWARD and msg.writes is not None
    assert all(t.device.type == "cpu" for t in device_parts(msg).values()), "the message travels on the host"
    assert logits.device == CUDA and k.device == CUDA and v.device == CUDA
    assert audit.off_device_after_transfer() == [], "rank 0's step made tensors off the device"
    audit = DeviceAudit()
    with audit:
        assert other.execute(msg) is None
    assert audit.off_device_after_transfer() == [], "rank 1's step made tensors off the device"
    for rank_collectives in collectives:
        assert {d for _, d in rank_collectives.devices} == {CUDA}
        assert sum(op == "all_reduce" for op, _ in rank_collectives.devices) == 2 * SMOLLM2.num_layers


def test_message_lands_on_the_device_in_one_transfer(fake_ranks):
    """A host message's device part: every index in one transfer, the KV rows in a second;
    the host fields (block pairs, prefill tuples, decode groups' block counts) stay as they are."""
    runner = fake_ranks[0]
    input_ids, positions, meta, logits_indices = runner.prepare(BATCHES["decodes"][0](), device=torch.device("cpu"))
    writes = KVWrites(torch.tensor([5, 9]), torch.zeros(2, SMOLLM2.num_kv_heads, SMOLLM2.head_dim))
    msg = StepMessage(StepOp.FORWARD, writes, copies=[(3, 4)], forward=ForwardInputs(
        input_ids, positions, meta, torch.tensor([1, 2]), logits_indices))
    audit = DeviceAudit()
    with audit:
        moved = on_device(msg, CUDA)
    assert len(audit.transfers) == 2
    parts = device_parts(moved)
    assert parts.keys() == device_parts(msg).keys() and len(parts) == 12  # 2 decode groups
    assert moved.writes is not None and moved.writes.rows is not None and moved.forward is not None
    assert all(t.device == CUDA for t in parts.values()) and moved.writes.rows.device == CUDA
    assert moved.copies == [(3, 4)] and [g.num_blocks for g in moved.forward.meta.decode_groups] == \
        [g.num_blocks for g in meta.decode_groups]
    assert audit.off_device_after_transfer() == []
