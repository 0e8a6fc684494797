"""The fake_cuda fixture of every test here (see fake_cuda.py)."""

from __future__ import annotations

import pytest
from fake_cuda import fake_cuda_bindings, fake_to_device, fake_to_host
from torch._subclasses.fake_tensor import FakeTensorMode

from tandem.engine import step_inputs
from tandem.kernels import ops


@pytest.fixture
def fake_cuda(monkeypatch):
    """FakeTensorMode with the step's crossings to and from the device (step_inputs) made
    fake, and attention on the torch path (Triton kernels cannot run on fake tensors: their
    launches are checked in test_triton_launches.py)."""
    monkeypatch.setattr(step_inputs, "to_device", fake_to_device)
    monkeypatch.setattr(step_inputs, "to_host", fake_to_host)
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    with FakeTensorMode(), fake_cuda_bindings():
        yield
