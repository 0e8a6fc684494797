"""Faults injected into a worker's engine on purpose, for the fault table's tests: a worker
takes them only when started with fault_injection=True."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from tandem.engine.engine import LLMEngine

FAULTS = ("step", "out_of_memory")
"""step: the next engine step raises a RuntimeError; out_of_memory: the next forward raises
torch.OutOfMemoryError, as a GPU out of memory does."""


def _raise_once(fn: Callable[..., Any], error: BaseException, restore: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def failing(*args: Any, **kwargs: Any) -> Any:
        restore()
        raise error
    return failing


def inject(engine: LLMEngine, kind: str) -> None:
    """Make the engine's next step (with work to do) fail with the fault `kind` (FAULTS)."""
    if kind == "step":
        step = engine.step
        setattr(engine, "step", _raise_once(step, RuntimeError("injected fault in the engine step"),
                                            lambda: setattr(engine, "step", step)))
    elif kind == "out_of_memory":
        run = engine.runner.run
        setattr(engine.runner, "run",
                _raise_once(run, torch.OutOfMemoryError("injected: out of memory in the forward"),
                            lambda: setattr(engine.runner, "run", run)))
    else:
        raise ValueError(f"fault {kind!r} is not one of {FAULTS}")
