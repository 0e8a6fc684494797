"""The fence of the shared-memory path, across processes: once KVReceiver.abort returns, a
same-node writer in another process lands not a byte more in the request's blocks, even when
they are granted again to the next reservation; a writer hung inside a write holds abort
until the kernel drops its lock with it. And a killed owner's pool leaves no file behind,
its senders can tell it is gone, and a name that points at another file is not mapped."""

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
def test_a_killed_owners_pool_leaves_nothing_and_its_senders_see_it():
    files_before = set(os.listdir(SHM_DIR))
    parent, child = spawn.Pipe()
    owner = spawn.Process(target=own_a_pool, args=(SHAPE, child), daemon=True)
    owner.start()
    assert parent.poll(60)
    name = parent.recv()
    assert set(os.listdir(SHM_DIR)) <= files_before  # the pool's file has no name: nothing to clean up
    mapped = MappedPool(name, MappedPool.open(name), layout_for(SHAPE, torch.float32))
    try:
        assert mapped.owner_alive()
        os.kill(owner.pid, signal.SIGKILL)  # as Ray stops a worker: no cleanup runs in it
        owner.join(10)
        assert not mapped.owner_alive()  # so a sender lets go of it (KVSender.poll), and its memory is free
        with pytest.raises(OSError):
            MappedPool.open(name)
    finally:
        mapped.close()


def test_a_name_that_points_elsewhere_is_not_mapped(decode_side):
    pool, _ = decode_side
    other = HostSharedPool.create(SHAPE, torch.float32)
    try:
        # The same process and descriptor, another tag: what a reused pid would show.
        forged = f"tandem-kv-{os.getpid()}-{other.fd}-{'0' * 32}"
        fd = MappedPool.open(forged)
        with pytest.raises(ValueError, match="tag differs"):
            MappedPool(forged, fd, pool.layout)
        os.close(fd)
        read_end, write_end = os.pipe()
        try:
            with pytest.raises(ValueError, match="not a file"):
                MappedPool.open(f"tandem-kv-{os.getpid()}-{read_end}-{'0' * 32}")
        finally:
            os.close(read_end)
            os.close(write_end)
    finally:
        other.close()
