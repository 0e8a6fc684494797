"""The fence of the shared-memory path, across processes: once KVReceiver.abort returns, a
same-node writer in another process lands not a byte more in the request's blocks, even when
they are granted again to the next reservation; a writer hung inside a write holds abort
until the kernel drops its lock with it. And a killed owner's pool file goes (its watcher),
senders can tell, and files nobody owns are swept."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from shm_processes import REFUSED, WRITES, hold_the_lock, own_a_pool, write_forever
from tandem.kvtransfer.payload import layout_for
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.shared_pool import SHM_DIR, HostSharedPool, MappedPool

# Rows of 8 x 128 float32 (4 KiB): each layer's write of 512 tokens is 4 MiB, milliseconds long.
SHAPE = (3, 2, 48, 16, 8, 128)
BLOCKS = [40, 3, 17, 9, 30, 22, 5, 11, 36, 28, 14, 1, 45, 20, 33, 7, 25, 12, 38, 2, 44, 18, 27, 6,
          31, 15, 41, 8, 24, 35, 13, 47]
NUM_TOKENS = len(BLOCKS) * SHAPE[3]
spawn = multiprocessing.get_context("spawn")


@pytest.fixture
def decode_side():
    pool = HostSharedPool.create(SHAPE, torch.float32)
    assert pool is not None, "these tests need /dev/shm"
    receiver = KVReceiver(pool.kv_cache, timeout_s=60, shared_pool=pool)
    yield pool, receiver
    receiver.close()
    pool.close()


def request_rows(pool: HostSharedPool) -> torch.Tensor:
    """-> [layers, 2, tokens, heads, dim]: the request's rows as they sit in the pool now."""
    return pool.kv_cache[:, :, BLOCKS].flatten(2, 3).clone()


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.timeout(120)
def test_no_byte_lands_after_abort_returns(decode_side):
    pool, receiver = decode_side
    dest = receiver.expect("r", BLOCKS, NUM_TOKENS)
    counts, stop = spawn.Array("q", 2), spawn.Event()
    writer = spawn.Process(target=write_forever, args=(pool.name, pool.layout.as_dict(), dest, counts, stop),
                           daemon=True)
    writer.start()
    try:
        _wait(lambda: counts[WRITES] >= 3 * SHAPE[0], 60, "the writer never wrote")
        receiver.abort("r")
        after_abort = request_rows(pool)
        # The blocks go to the next reservation; the old writer keeps trying with its old grant.
        receiver.expect("next", BLOCKS, NUM_TOKENS)
        _wait(lambda: counts[REFUSED] >= 20, 30, "the writer never tried again")
        assert torch.equal(request_rows(pool), after_abort), "bytes landed after abort returned"
        # Each layer holds one whole write (K rows i, V rows -i): none was cut by the abort.
        for layer in after_abort:
            value = layer[0].flatten()[0].item()
            assert value >= 1 and (layer[0] == value).all() and (layer[1] == -value).all()
    finally:
        stop.set()
        writer.join(10)


@pytest.mark.timeout(120)
def test_a_writer_stopped_inside_a_write_holds_abort_until_it_dies(decode_side):
    pool, receiver = decode_side
    dest = receiver.expect("r", BLOCKS, NUM_TOKENS)
    holding = spawn.Event()
    writer = spawn.Process(target=hold_the_lock, args=(pool.name, pool.layout.as_dict(), dest, holding), daemon=True)
    writer.start()
    try:
        assert holding.wait(60)
        abort = threading.Thread(target=receiver.abort, args=("r",))
        abort.start()
        abort.join(0.5)
        assert abort.is_alive(), "abort returned while another process was inside a write"
        os.kill(writer.pid, signal.SIGKILL)
        abort.join(10)
        assert not abort.is_alive()
        assert not pool.fence.table[BLOCKS].any()  # revoked
    finally:
        writer.kill()
        writer.join(10)


@pytest.mark.timeout(120)
def test_a_killed_owners_pool_goes_and_its_senders_see_it():
    parent, child = spawn.Pipe()
    owner = spawn.Process(target=own_a_pool, args=(SHM_DIR, SHAPE, child), daemon=True)
    owner.start()
    assert parent.poll(60)
    path = parent.recv()
    name = os.path.basename(path)
    mapped = MappedPool(name, MappedPool.open(name), layout_for(SHAPE, torch.float32))
    try:
        assert mapped.owner_alive()
        os.kill(owner.pid, signal.SIGKILL)  # as Ray stops a worker: no cleanup runs in it
        owner.join(10)
        _wait(lambda: not os.path.exists(path), 10, "the killed owner's pool file stayed")  # its watcher's work
        assert not mapped.owner_alive()  # so a sender unmaps it (KVSender.poll)
    finally:
        mapped.close()


def test_pool_files_nobody_owns_are_swept(tmp_path):
    stale = tmp_path / f"tandem-kv-{'ab' * 16}"  # left by an owner that died with its watcher
    stale.write_bytes(b"\0" * 4096)
    live = HostSharedPool.create(SHAPE, torch.float32, str(tmp_path))
    other = HostSharedPool.create(SHAPE, torch.float32, str(tmp_path))
    try:
        assert not stale.exists()
        assert os.path.exists(live.path) and os.path.exists(other.path)  # a live owner's file stays
    finally:
        live.close()
        other.close()
    assert not os.listdir(tmp_path)
