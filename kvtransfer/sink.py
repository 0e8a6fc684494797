"""Where a KV receiver writes the rows that arrive: one pool tensor in place, or elsewhere
(a tensor-parallel worker's ranks each hold some of the heads)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tandem.kvtransfer.payload import layer_rows, layout_of
from tandem.kvtransfer.protocol import KVLayout
from tandem.kvtransfer.slots import contiguous_runs
from tandem.kvtransfer.staging import to_device


class KVSink(Protocol):
    """Where arriving KV rows go, when not straight into one pool tensor (a tensor-parallel
    worker's ranks each hold some of the heads)."""

    layout: KVLayout
    """The pool as senders see it: every KV head of the model."""

    def write(self, layer: int, kv: int, slots: np.ndarray, parts: list[torch.Tensor]) -> None:
        """Rows for ``slots`` of ``layer``'s K (kv=0) or V (kv=1), as pieces [n_i, heads, dim]
        in slot order; the pieces are views of a message, valid only during the call."""


class PoolSink:
    """Rows written in place into a pool tensor."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.layout = layout_of(kv_cache)

    def write(self, layer: int, kv: int, slots: np.ndarray, parts: list[torch.Tensor]) -> None:
        write_rows(layer_rows(self.kv_cache, layer, kv), slots, parts)


def write_rows(dst: torch.Tensor, slots: np.ndarray, parts: list[torch.Tensor]) -> None:
    """dst[slots[i]] = the i-th row of the concatenated parts; slice copies where slots run
    side by side (faster than index_copy_), one index_copy_ per part where they are scattered.
    Rows in host memory for a pool on a GPU cross to it first, in one copy: the writes run there."""
    if parts and parts[0].device != dst.device:
        parts = [to_device(parts, dst.device)]
    runs = contiguous_runs(slots)
    if len(runs) > 8:
        offset = 0
        index = torch.from_numpy(slots).to(dst.device)
        for rows in parts:
            dst.index_copy_(0, index[offset:offset + len(rows)], rows)
            offset += len(rows)
        return
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    offset = 0
    for first, n in runs:
        dst[first:first + n].copy_(rows[offset:offset + n])
        offset += n
