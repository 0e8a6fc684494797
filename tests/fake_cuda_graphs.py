"""A stand-in for CUDA graphs (tandem/engine/cuda_graphs.py's GraphDevice) on a machine
without a GPU, following the rules of the real ones rather than the code's convenience:

- capturing runs the Python once (as torch.cuda.graph does, recording the launches); a
  replay runs none of the caller's code, only what was captured, so here it calls the captured
  callable itself: whatever it reads, it reads from the static buffers' current contents;
- a graph reads the addresses it captured: a replay whose captured inputs were moved,
  reshaped or restrided fails (a buffer replaced instead of refilled would be read stale);
- captures share the pool they are given, from graph_pool; none nests in another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def _address(t: torch.Tensor) -> int | None:
    """The tensor's device address (None for a fake tensor, which has none: its identity stands in)."""
    return None if isinstance(t, FakeTensor) else t.data_ptr()


@dataclass
class FakeGraph:
    fn: Callable[[], None]
    inputs: list[tuple[torch.Tensor, int | None, torch.Size, tuple[int, ...]]]
    """(tensor, address, shape, strides) of each static input at capture."""
    pool: Any

    def check(self) -> None:
        for t, address, shape, strides in self.inputs:
            assert (_address(t), t.shape, t.stride()) == (address, shape, strides), \
                "a captured input moved or changed shape: the graph would read its old memory"


class FakeGraphDevice:
    """Records captures and replays; see the module's docstring for the rules it keeps."""

    def __init__(self, free_bytes: int = 64 * 2**30, bytes_per_capture: int = 2**20) -> None:
        self.free = free_bytes
        self.bytes_per_capture = bytes_per_capture
        self.pools: list[object] = []
        self.captures: list[FakeGraph] = []
        self.replays: list[FakeGraph] = []
        self.warm_ups = 0
        self._capturing = False

    def graph_pool(self) -> Any:
        pool = object()
        self.pools.append(pool)
        return pool

    def warm_up(self, fn: Callable[[], None]) -> None:
        self.warm_ups += 1
        fn()

    def capture(self, fn: Callable[[], None], static_inputs: Sequence[torch.Tensor], pool: Any) -> FakeGraph:
        assert not self._capturing, "a capture inside a capture"
        assert any(pool is p for p in self.pools), "a pool graph_pool did not make"
        graph = FakeGraph(fn, [(t, _address(t), t.shape, t.stride()) for t in static_inputs], pool)
        self._capturing = True
        try:
            fn()
        finally:
            self._capturing = False
        self.free -= self.bytes_per_capture
        self.captures.append(graph)
        return graph

    def replay(self, graph: FakeGraph) -> None:
        assert any(graph is g for g in self.captures), "replaying a graph never captured"
        graph.check()
        graph.fn()
        self.replays.append(graph)

    def free_bytes(self) -> int:
        return self.free

    def synchronize(self) -> None:
        pass
