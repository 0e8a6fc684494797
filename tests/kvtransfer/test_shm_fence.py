"""The fence of the shared-memory path, across processes: once KVReceiver.abort has fenced a
request (at once, or at its ABORTED event), a same-node writer in another process lands not a
byte more in its blocks, even when they are granted again to the next reservation; a writer
stopped inside a write holds its request's blocks (never abort, nor other grants) until it
resumes or the kernel drops its lock with it, wherever the stop lands. And a killed owner's
pool leaves no file behind, its senders can tell it is gone, and a name that points at another
file is not mapped."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
from shm_processes import REFUSED, WRITES, hold_the_lock, own_a_pool, write_forever, write_what_is_given

from tandem.kvtransfer.payload import layout_for
from tandem.kvtransfer.protocol import AbortOutcome, TransferStatus
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.shared_pool import SHM_DIR, HostSharedPool, MappedPool

# Rows of 8 x 128 float32 (4 KiB): each layer's write of 512 tokens is 4 MiB, milliseconds long.
SHAPE = (3, 2, 48, 16, 8, 128)
BLOCKS = [40, 3, 17, 9, 30, 22, 5, 11, 36, 28, 14, 1, 45, 20, 33, 7, 25, 12, 38, 2, 44, 18, 27, 6,
          31, 15, 41, 8, 24, 35, 13, 47]
NUM_TOKENS = len(BLOCKS) * SHAPE[3]
spawn = multiprocessing.get_context("spawn")
logger = logging.getLogger(__name__)


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
        if receiver.abort("r") is AbortOutcome.REVOKING:  # a write was under way: its end is reported
            event = receiver.get_event(30)
            assert event is not None and (event.request_id, event.status) == ("r", TransferStatus.ABORTED)
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
def test_a_writer_stopped_inside_a_write_never_holds_abort(decode_side):
    """abort returns at once; the blocks' grant stands (they must stay out of the pool) until
    the kernel drops the writer's lock with it; other reservations are granted meanwhile."""
    pool, receiver = decode_side
    dest = receiver.expect("r", BLOCKS, NUM_TOKENS)
    holding = spawn.Event()
    writer = spawn.Process(target=hold_the_lock, args=(pool.name, pool.layout.as_dict(), dest, holding), daemon=True)
    writer.start()
    assert writer.pid is not None
    try:
        assert holding.wait(60)
        started = time.monotonic()
        assert receiver.abort("r") is AbortOutcome.REVOKING
        assert receiver.abort("r") is AbortOutcome.REVOKING  # (asked again: still waiting)
        other = receiver.expect("other", [0], SHAPE[3])  # a grant elsewhere in the pool is not held up
        assert time.monotonic() - started < 1.0
        assert receiver.get_event(0.5) is None and pool.fence.table[BLOCKS].all()  # not yet revoked
        os.kill(writer.pid, signal.SIGKILL)
        event = receiver.get_event(10)
        assert event is not None and (event.request_id, event.status) == ("r", TransferStatus.ABORTED)
        assert not pool.fence.table[BLOCKS].any()  # revoked
        assert receiver.abort("r") is AbortOutcome.NOT_PENDING
        assert pool.fence.table[other.block_ids[0]] == other.shm_grant
    finally:
        writer.kill()
        writer.join(10)


NUM_STOP_POINTS = 20
OTHER_BLOCKS = sorted(set(range(SHAPE[2])) - set(BLOCKS))


@pytest.mark.timeout(300)
def test_a_writer_stopped_at_any_point_never_wedges_the_receiver(decode_side):
    """Stopped (SIGSTOP) at 20 seeded points of its writes while the receiver's owner aborts its
    request: abort never waits, other reservations are granted meanwhile, the blocks stay
    granted to the stopped writer (so out of the pool) only when the stop cut a write, and once
    it resumes not a byte of it lands after the ABORTED event."""
    pool, receiver = decode_side
    parent, child = spawn.Pipe()
    counts, stop = spawn.Array("q", 2), spawn.Event()
    writer = spawn.Process(target=write_what_is_given, args=(pool.name, pool.layout.as_dict(), child, counts, stop),
                           daemon=True)
    writer.start()
    assert writer.pid is not None
    rng = random.Random(32)
    outcomes = []
    try:
        for point in range(NUM_STOP_POINTS):
            rid = f"r{point}"
            parent.send(receiver.expect(rid, BLOCKS, NUM_TOKENS))
            written = counts[WRITES]
            _wait(lambda: counts[WRITES] >= written + 1, 60, "the writer never wrote")
            time.sleep(rng.uniform(0, 0.02))  # inside a layer's write, or between two
            os.kill(writer.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                outcome = receiver.abort(rid)
                other = receiver.expect(f"other{point}", OTHER_BLOCKS[:2], 2 * SHAPE[3])
                assert pool.fence.table[other.block_ids[0]] == other.shm_grant
                receiver.abort(other.request_id)
                assert time.monotonic() - started < 1.0, "abort or a grant waited for the stopped writer"
                if outcome is AbortOutcome.REVOKING:  # the stop cut a write: its grant must stand
                    assert receiver.get_event(0.1) is None and pool.fence.table[BLOCKS].all()
                else:
                    assert outcome is AbortOutcome.FENCED and not pool.fence.table[BLOCKS].any()
            finally:
                os.kill(writer.pid, signal.SIGCONT)
            if outcome is AbortOutcome.REVOKING:
                event = receiver.get_event(10)
                assert event is not None and (event.request_id, event.status) == (rid, TransferStatus.ABORTED)
            assert not pool.fence.table[BLOCKS].any()
            after = request_rows(pool)
            refused = counts[REFUSED]
            _wait(lambda: counts[REFUSED] >= refused + SHAPE[0], 30, "the writer never tried again")
            assert (request_rows(pool) == after).all(), f"stop point {point}: bytes landed after the revoke"
            outcomes.append(outcome)
    finally:
        stop.set()
        os.kill(writer.pid, signal.SIGCONT)
        writer.join(10)
        writer.kill()
    logger.info("stop points: %d cut a write, %d between writes", outcomes.count(AbortOutcome.REVOKING),
                outcomes.count(AbortOutcome.FENCED))
    assert len(outcomes) == NUM_STOP_POINTS and AbortOutcome.REVOKING in outcomes


@pytest.mark.timeout(120)
def test_a_killed_owners_pool_leaves_nothing_and_its_senders_see_it():
    files_before = set(os.listdir(SHM_DIR))
    parent, child = spawn.Pipe()
    owner = spawn.Process(target=own_a_pool, args=(SHAPE, child), daemon=True)
    owner.start()
    assert owner.pid is not None
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
    assert other is not None
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
