"""The one dispatch switch: its values, and a clear error where Triton cannot run."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.ops import BACKEND_ENV, Backend, backend_for

cpu = torch.empty(0)


def test_auto_runs_torch_on_cpu_tensors(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(cpu) is Backend.TORCH
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert backend_for(cpu) is Backend.TORCH


def test_forcing_either_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert backend_for(cpu) is Backend.TRITON
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert backend_for(cpu) is Backend.TORCH


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend_for(cpu)


def test_unknown_backend_names_the_choices(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        backend_for(cpu)
