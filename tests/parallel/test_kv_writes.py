"""KV that arrives for a tensor-parallel worker waits on its first rank as exact cache rows."""

from __future__ import annotations

import numpy as np
import torch

from tandem.kvtransfer.protocol import KVLayout
from tandem.parallel.kv_writes import PendingKVWrites

LAYOUT = KVLayout(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=1, dtype="float32")
NUM_SLOTS = 8


def rows(*values: float) -> torch.Tensor:
    """[n, 3 heads, 1]: head h of row i holds values[i] + h / 10."""
    return torch.tensor([[[v + h / 10] for h in range(3)] for v in values])


def test_rows_index_the_cache_flattened_over_layer_kv_and_slot():
    writes = PendingKVWrites(LAYOUT)
    assert writes.take() is None
    writes.write(0, 1, np.array([2, 3]), [rows(1.0), rows(2.0)])  # layer 0 V: rows 8 + slot
    writes.write(1, 0, np.array([6]), [rows(3.0)])  # layer 1 K: rows 16 + slot
    assert writes.num_rows == 3
    taken = writes.take()
    assert taken is not None and taken.rows is not None
    assert taken.index.tolist() == [10, 11, 22]
    assert torch.equal(taken.rows, rows(1.0, 2.0, 3.0))
    assert writes.take() is None and writes.num_rows == 0


def test_a_slot_written_twice_keeps_its_last_rows():
    """An aborted request's rows, then its block's next owner's, before the next step."""
    writes = PendingKVWrites(LAYOUT)
    writes.write(0, 0, np.array([4, 5]), [rows(1.0, 2.0)])
    writes.write(0, 0, np.array([5, 6]), [rows(3.0, 4.0)])
    taken = writes.take()
    assert taken is not None and taken.rows is not None
    assert taken.index.tolist() == [4, 5, 6]
    assert torch.equal(taken.rows, rows(1.0, 3.0, 4.0))


def test_rows_are_copied_out_of_the_message():
    writes = PendingKVWrites(LAYOUT)
    message = rows(1.0)
    writes.write(0, 0, np.array([0]), [message])
    message.zero_()
    taken = writes.take()
    assert taken is not None and taken.rows is not None
    assert torch.equal(taken.rows, rows(1.0))
