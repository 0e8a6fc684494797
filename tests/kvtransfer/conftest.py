"""The receiver the message-level tests (test_faults, test_grants) send raw messages to."""

from __future__ import annotations

import pytest
import torch
from kv_pools import random_pool
from raw_sender import BLOCK_SIZE, BLOCKS, DIM, HEADS, LAYERS

from tandem.kvtransfer.receiver import KVReceiver


@pytest.fixture
def receiver():
    r = KVReceiver(random_pool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, seed=3), timeout_s=10)
    yield r
    r.close()
