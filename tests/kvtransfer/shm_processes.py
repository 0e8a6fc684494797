"""Child processes for the shared-memory tests: a same-node writer mapping a decode pool, and a
pool owner that gets killed. Spawned (fresh interpreters), so only their
arguments cross: a pool's name, its layout, a Destination, multiprocessing primitives."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event

import torch

from tandem.kvtransfer.in_place import InPlaceWrites
from tandem.kvtransfer.protocol import Destination, KVLayout
from tandem.kvtransfer.shared_pool import HostSharedPool, MappedPool

WRITES, REFUSED = 0, 1  # indexes of the writer's counts


def _mapped(name: str, layout: dict) -> MappedPool:
    return MappedPool(name, MappedPool.open(name), KVLayout.from_dict(layout))


def write_forever(name: str, layout: dict, dest: Destination, counts: SynchronizedArray, stop: Event) -> None:
    """Write every layer of `dest`'s tokens again and again, the i-th time with rows all equal
    to i, through the production write path (fence and copy); count writes and refusals."""
    torch.set_num_threads(1)
    pool = _mapped(name, layout)
    n = dest.num_tokens - dest.num_cached_tokens
    rows = torch.empty(2, n, pool.layout.num_kv_heads, pool.layout.head_dim)  # K, V
    i = 0
    while not stop.is_set():
        i += 1
        rows[0].fill_(i)
        rows[1].fill_(-i)
        writes = InPlaceWrites(pool, dest, pool.layout.block_size)  # each round from the start
        for layer in range(pool.layout.num_layers):
            ok = writes.write(layer, dest.num_cached_tokens, dest.num_tokens, rows, None)
            with counts.get_lock():
                counts[WRITES if ok else REFUSED] += 1


def hold_the_lock(name: str, layout: dict, dest: Destination, holding: Event) -> None:
    """Take the reservation's lock as a writer does, then stop inside the write (hung)."""
    pool = _mapped(name, layout)
    slot = dest.block_ids[dest.num_cached_tokens // pool.layout.block_size]
    with pool.fence.writing(slot, dest.shm_grant, dest.block_ids) as granted:
        assert granted
        holding.set()
        time.sleep(3600)


def own_a_pool(shape: tuple[int, ...], conn: Connection) -> None:
    """Make a shared pool, give its name, and wait to be killed (no cleanup runs)."""
    pool = HostSharedPool.create(shape, torch.float32)
    assert pool is not None
    conn.send(pool.name)
    time.sleep(3600)


def write_what_is_given(name: str, layout: dict, dests: Connection, counts: SynchronizedArray, stop: Event) -> None:
    """As write_forever, each round for the latest Destination sent down `dests` (none yet: wait)."""
    torch.set_num_threads(1)
    pool = _mapped(name, layout)
    dest, rows, i = None, None, 0
    while not stop.is_set():
        if dests.poll(0 if dest is not None else 0.01):
            dest = dests.recv()
            rows = torch.empty(2, dest.num_tokens - dest.num_cached_tokens, pool.layout.num_kv_heads,
                               pool.layout.head_dim)
        if dest is None or rows is None:
            continue
        i += 1
        rows[0].fill_(i)
        rows[1].fill_(-i)
        writes = InPlaceWrites(pool, dest, pool.layout.block_size)
        for layer in range(pool.layout.num_layers):
            ok = writes.write(layer, dest.num_cached_tokens, dest.num_tokens, rows, None)
            with counts.get_lock():
                counts[WRITES if ok else REFUSED] += 1
