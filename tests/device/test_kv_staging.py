"""The KV staging of a pool on a GPU, on fake CUDA (FakeTensorMode, no GPU needed): the slot
index goes to the device, the K and V rows are gathered there into one tensor, and only that
one crosses to the host; a host index would not do (FakeTensorMode raises on mixed devices).
The receiver's rows cross to the pool's device in one copy before they are written."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tandem.kvtransfer.payload import layer_rows
from tandem.kvtransfer.staging import Staging, gather_rows

SHAPE = (30, 2, 64, 16, 3, 64)  # the default model's pool: 30 layers, 3 KV heads of 64


class RecordingOps:
    """DeviceOps that records what crosses between host and device (fake CUDA can't copy)."""

    def __init__(self) -> None:
        self.uploads: list[int] = []
        self.downloads: list[torch.Tensor] = []
        self.on_side = 0

    @contextlib.contextmanager
    def side(self):
        self.on_side += 1
        yield

    def upload(self, slots: np.ndarray) -> torch.Tensor:
        self.uploads.append(len(slots))
        return torch.empty(len(slots), dtype=torch.int64, device="cuda")

    def download(self, rows: torch.Tensor):
        self.downloads.append(rows)
        return torch.empty(rows.shape, dtype=rows.dtype), lambda: True


def test_a_layer_is_gathered_on_the_device_and_crosses_once():
    ops = RecordingOps()
    slots = np.array([5, 6, 7, 40, 41, 200])
    with FakeTensorMode():
        pool = torch.empty(SHAPE, dtype=torch.float16, device="cuda")
        staged = Staging(ops).stage(pool, 12, slots)
    assert ops.on_side == 1 and ops.uploads == [len(slots)]
    (rows,) = ops.downloads
    assert rows.device.type == "cuda" and tuple(rows.shape) == (2, len(slots), 3, 64)
    assert staged.host.device.type == "cpu" and staged.host.dtype == torch.float16 and staged.ready()


def test_a_host_index_would_mix_devices():
    with FakeTensorMode():
        pool = torch.empty(SHAPE, dtype=torch.float16, device="cuda")
        with pytest.raises(Exception, match="device"):
            gather_rows(pool, 0, torch.arange(3))
        assert layer_rows(pool, 3, 1).device.type == "cuda"  # a view: no host index either
