"""Defect 2: KV rows that arrived on the device (DistPayload.recv over NCCL gives CUDA
tensors) go into a tensor-parallel step as they are: never pinned (only dense CPU tensors
can be), never copied. Run with the real step_inputs.to_device under fake CUDA, at the
default model's shapes, with pin_memory doing what CUDA torch does."""

from __future__ import annotations

import fake_nccl
import pytest
import torch
from fake_cuda import CUDA, SMOLLM2
from torch._guards import detect_fake_mode

from tandem.engine import step_inputs
from tandem.parallel.step_message import KVWrites, StepMessage, StepOp, on_device

PIN = torch.Tensor.pin_memory


def cuda_pin_memory(t: torch.Tensor, device=None) -> torch.Tensor:
    """Tensor.pin_memory as torch with CUDA behaves: host memory pinned (here: itself), any
    other tensor refused with torch's words."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
    return t


@pytest.fixture
def real_crossing(fake_cuda, monkeypatch):
    monkeypatch.setattr(step_inputs, "to_device", REAL_TO_DEVICE)
    monkeypatch.setattr(torch.Tensor, "pin_memory", cuda_pin_memory)
    mode = detect_fake_mode()
    assert mode is not None  # fake_cuda's
    fake_nccl.use_mode(mode)


REAL_TO_DEVICE = step_inputs.to_device


def test_rows_received_on_the_device_stay_there(real_crossing):
    # What DistPayload.recv gives on a NCCL pair: rows of every KV head, on the device.
    rows = fake_nccl.empty(6, SMOLLM2.num_kv_heads, SMOLLM2.head_dim, dtype=torch.bfloat16, device=CUDA)
    msg = StepMessage(StepOp.SWAP, KVWrites(torch.arange(6), rows))
    moved = on_device(msg, CUDA)
    assert moved.writes is not None
    assert moved.writes.rows is rows, "rows already on the device were copied"
    assert moved.writes.index.device == CUDA
    assert step_inputs.to_device(rows, torch.device("cuda")) is rows
