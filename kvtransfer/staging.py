"""KV rows of a pool on a GPU on their way into ZMQ frames: gathered on the device, copied
into pinned host memory asynchronously on a side CUDA stream, and sent once the copy is done.

Why: a socket reads host memory. Copying each layer to the host on the forward's own
stream would stall the forward once per layer; on a side stream the copy of layer i runs
while layer i+1 computes, and the sender sends layer i's message when its event has fired
(`StagedLayer.ready`). A message's frames are views of its pinned buffer, which lives as
long as ZMQ holds the frames (the numpy views keep the tensor alive).

The device work goes through a `DeviceOps` (the seam): `CudaOps` on a GPU; tests put
fakes in its place under FakeTensorMode, where `cuda` tensors exist on a CPU-only machine
but crossing to the host does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch


def gather_rows(kv_cache: torch.Tensor, layer: int, index: torch.Tensor) -> torch.Tensor:
    """-> [2, len(index), kv_heads, head_dim] on kv_cache's device: the K and the V rows of
    cache slots `index` (on the same device) of `layer`, in one tensor: one copy to the host."""
    return kv_cache.select(0, layer).flatten(1, 2).index_select(1, index)  # (select: no host index)


class DeviceOps(Protocol):
    """What staging asks of the device."""

    def upload(self, slots: np.ndarray) -> torch.Tensor:
        """-> `slots` as an int64 index on the device (queued on the side stream)."""

    def download(self, rows: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
        """-> (a host tensor that will hold `rows`, whether the copy has finished)."""

    def side(self):
        """A context manager under which device work goes on the side stream, after what
        the compute stream has queued so far (the layer's KV is written by then)."""


class CudaOps:
    """DeviceOps on a CUDA device: a side stream, pinned buffers, an event per copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def side(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def upload(self, slots: np.ndarray) -> torch.Tensor:
        # Pinned, so the copy is truly asynchronous; the caching host allocator keeps the
        # buffer until the stream has used it (record_stream is implied for pinned memory).
        host = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).pin_memory()
        return host.to(self.device, non_blocking=True)

    def download(self, rows: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        return host, done.query


@dataclass
class StagedLayer:
    """One layer's rows on their way to the host."""

    host: torch.Tensor
    """[2, n, kv_heads, head_dim] in (pinned) host memory: K is host[0], V host[1]; valid once ready."""
    ready: Callable[[], bool]
    """Whether the copy has finished (never blocks)."""
    keep: tuple[torch.Tensor, ...] = ()
    """Device tensors the copy reads, kept until it is done."""


class Staging:
    """Stages layers of a pool on a device through the host (one per sender)."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops

    @classmethod
    def for_pool(cls, kv_cache: torch.Tensor) -> Staging | None:
        """-> a Staging for a pool on a CUDA device, or None for one in host memory (its
        frames are views of the pool itself)."""
        return cls(CudaOps(kv_cache.device)) if kv_cache.is_cuda else None

    def stage(self, kv_cache: torch.Tensor, layer: int, slots: np.ndarray) -> StagedLayer:
        """Queue `layer`'s K and V rows of cache `slots` (in token order) to the host; returns at once."""
        with self.ops.side():
            index = self.ops.upload(slots)
            rows = gather_rows(kv_cache, layer, index)
            host, ready = self.ops.download(rows)
        return StagedLayer(host, ready, (index, rows))


def to_device(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The receiver's side: rows that arrived (pieces of one message, in order) -> one tensor
    on the pool's device, so that the writes into the pool run there: from host memory in
    one copy; rows already there (they came by NCCL) as they are, never pinned nor copied.
    NOTE: a synchronous copy: the pieces are views of a message valid only now."""
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows if rows.device == device else rows.to(device)
