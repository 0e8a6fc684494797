"""Session fixtures: the default model is loaded once, and engines are built on its weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run on CPU tensors through Triton's interpreter, which is chosen
    # when a kernel module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fault_report import FaultReport
from mypy_run import MYPY_RUN, MypyRun

from tandem import LLM
from tandem.model.loader import LoadedModel, load_hf_model, loaded_from_hf_model
from tandem.model.source import resolve_model_source


@pytest.fixture(scope="session")
def hf_model_and_tokenizer():
    """transformers' own model: the independent reference for every output check."""
    source = resolve_model_source(None)
    return load_hf_model(source)


@pytest.fixture(scope="session")
def hf_model(hf_model_and_tokenizer):
    return hf_model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(hf_model_and_tokenizer):
    return hf_model_and_tokenizer[1]


@pytest.fixture(scope="session")
def loaded(hf_model_and_tokenizer) -> LoadedModel:
    hf_model, tokenizer = hf_model_and_tokenizer
    return loaded_from_hf_model(hf_model, tokenizer, "SmolLM2-135M-Instruct", torch.float32)


@pytest.fixture(scope="session")
def make_llm(loaded):
    """Build a fresh engine (own KV pool and scheduler) on the shared weights."""

    def make(**engine_args) -> LLM:
        engine_args.setdefault("kv_cache_memory_gib", 0.25)
        return LLM.from_loaded(loaded, **engine_args)

    return make


_FAULT_REPORT = pytest.StashKey[FaultReport]()


@pytest.fixture(scope="session")
def fault_report(request) -> FaultReport:
    """Where fault tests add their row; printed as one table at the end of the session."""
    return request.config.stash.setdefault(_FAULT_REPORT, FaultReport())


def pytest_terminal_summary(terminalreporter, config) -> None:
    report = config.stash.get(_FAULT_REPORT, None)
    if report is not None and report.rows:
        terminalreporter.section("faults injected (every row: 0 blocks leaked, each request a clear status)")
        for line in report.table():
            terminalreporter.write_line(line)


CLUSTER_TESTS = Path(__file__).parent / "cluster"
"""The tests of the session's shared clusters (tests/cluster/conftest.py)."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared clusters' tests after every other, in their own order: their Ray and
    workers stay up until the session ends, and idle they still take CPU from every test
    after them (the engine's transformers checks ran 1.5x slower behind them)."""
    items[:] = ([item for item in items if CLUSTER_TESTS not in item.path.parents]
                + [item for item in items if CLUSTER_TESTS in item.path.parents])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start test_lint.py's mypy run now, niced (see mypy_run.py)."""
    if any(item.name == "test_mypy_finds_nothing" for item in session.items):
        session.config.stash[MYPY_RUN] = MypyRun.start(niceness=10)


def pytest_sessionfinish(session: pytest.Session) -> None:
    mypy = session.config.stash.get(MYPY_RUN, None)
    if mypy is not None:
        mypy.stop()
