"""KV that another worker sends to a tensor-parallel worker: held on the first rank until its
next step message carries it to every rank, each of which writes its own heads.

NOTE: why holding is safe. A request's KV is complete (its DONE event) only once every
layer is held here, and it is scheduled only after that, so the step that first reads it
carries it. When a request is aborted, rows held for its blocks still go out with the next
message, before any forward that writes the blocks for their next owner: that owner's own
KV lands after them. Rows are applied in arrival order on every rank.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tandem.kvtransfer.protocol import KVLayout
from tandem.parallel.step_message import KVWrites


class PendingKVWrites:
    """A KVReceiver sink (see kvtransfer.sink.KVSink) that holds rows for the ranks."""

    def __init__(self, layout: KVLayout, num_pool_blocks: int | None = None) -> None:
        """layout: every KV head of the model (what senders send), this worker's blocks.
        num_pool_blocks: blocks per layer in the ranks' pools (default: the layout's), which
        may hold one more than senders see: the scratch block of padded decodes."""
        self.layout = layout
        self._num_slots = (layout.num_blocks if num_pool_blocks is None else num_pool_blocks) * layout.block_size
        self._lock = threading.Lock()
        self._index: list[torch.Tensor] = []
        self._rows: list[torch.Tensor] = []

    def write(self, layer: int, kv: int, slots: np.ndarray, parts: list[torch.Tensor]) -> None:
        # index into the cache viewed as [num_layers * 2 * num_slots] rows (see RankExecutor)
        index = torch.from_numpy(slots.astype(np.int64)) + (layer * 2 + kv) * self._num_slots
        rows = torch.cat(parts)  # a copy: the parts are views of a message that goes away
        with self._lock:
            self._index.append(index)
            self._rows.append(rows)

    def take(self) -> KVWrites | None:
        """Everything held so far (then nothing is held), or None."""
        with self._lock:
            if not self._index:
                return None
            index_parts, row_parts = self._index, self._rows
            self._index, self._rows = [], []
        index, rows = torch.cat(index_parts), torch.cat(row_parts)
        # A slot written twice (an aborted request's rows, then its block's next owner's):
        # only the last write counts, and index_copy_ does not promise an order.
        _, last_from_end = np.unique(index.numpy()[::-1], return_index=True)
        if len(last_from_end) < len(index):
            keep = torch.from_numpy(np.sort(len(index) - 1 - last_from_end))
            index, rows = index[keep], rows[keep]
        return KVWrites(index, rows)

    @property
    def num_rows(self) -> int:
        with self._lock:
            return sum(len(i) for i in self._index)
