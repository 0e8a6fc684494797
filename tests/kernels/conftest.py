"""Fixtures for the compiled CPU kernels: a process that has loaded none yet, and one on a
machine where they cannot be built."""

from __future__ import annotations

import pytest

from tandem.kernels import cpu_build


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """As in a fresh process: no extension loaded or failed yet (restored afterwards)."""
    monkeypatch.setattr(cpu_build, "_modules", {})
    monkeypatch.setattr(cpu_build, "_failed", set())


@pytest.fixture
def empty_kernel_cache(fresh_kernel_state, monkeypatch, tmp_path):
    """A fresh process whose kernel cache holds nothing built."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def no_compiler(empty_kernel_cache, monkeypatch):
    """A fresh process on a machine where no extension can be built."""
    def fail(ext):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(cpu_build, "_compile", fail)
