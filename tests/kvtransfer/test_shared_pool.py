"""The shared-memory path in one process: a same-node sender writes the rows straight into the
receiver's pool (a file under /dev/shm) and sends headers alone; the receiver checks them
like any other and refuses in-place headers from senders that did not negotiate the path;
the sender writes only its own reservation's slots, in order; and without a common node, a
mappable pool or room in /dev/shm, everything goes by socket as before."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from kv_pools import pick_blocks, random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer import shared_pool as shared_pool_module
from tandem.kvtransfer.fence import ofd_unlock
from tandem.kvtransfer.handshake import SharedPool
from tandem.kvtransfer.protocol import MessageKind, TransferStatus, decode, encode
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.row_copy import row_copier
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.shared_pool import HostSharedPool
from tandem.kvtransfer.slots import token_slots

LAYERS, HEADS, DIM = 3, 2, 8


def shared_receiver(num_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> KVReceiver:
    """A receiver whose pool is in shared memory, filled with random bytes (to see what changes)."""
    pool = HostSharedPool.create((LAYERS, 2, num_blocks, block_size, HEADS, DIM), dtype)
    assert pool is not None, "these tests need /dev/shm"
    pool.kv_cache.copy_(random_pool(LAYERS, num_blocks, block_size, HEADS, DIM, dtype, seed))
    return KVReceiver(pool.kv_cache, timeout_s=10, shared_pool=pool)


def pool_of(receiver: KVReceiver) -> torch.Tensor:
    """The receiver's pool (every receiver here has one: no sink)."""
    assert receiver.kv_cache is not None
    return receiver.kv_cache


def shared_pool_of(receiver: KVReceiver) -> SharedPool:
    """The receiver's pool in shared memory (shared_receiver's)."""
    assert receiver.shared_pool is not None
    return receiver.shared_pool


def close(sender: KVSender | None, receiver: KVReceiver) -> None:
    if sender is not None:
        sender.close()
    receiver.close()
    if receiver.shared_pool is not None:
        receiver.shared_pool.close()


def send_all(sender: KVSender, request_id: str, start: int, split: int, end: int) -> None:
    """Every layer of tokens [start, end), in two chunks as chunked prefill sends them."""
    for chunk in ((start, split), (split, end)):
        for layer in range(LAYERS):
            if chunk[0] < chunk[1]:
                assert sender.send_layer(request_id, layer, *chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("src_block_size, dst_block_size", [(16, 16), (16, 4), (5, 16)])
def test_rows_land_in_place_byte_exact(dtype, src_block_size, dst_block_size):
    rng = random.Random(src_block_size * 100 + dst_block_size)
    src = random_pool(LAYERS, 64, src_block_size, HEADS, DIM, dtype, seed=1)
    receiver = shared_receiver(48, dst_block_size, dtype, seed=2)
    dst = pool_of(receiver)
    before = dst.clone()
    sender = KVSender(src)
    messages: list[int] = []
    send = sender.send_message

    def counting_send(rid: str, frames: list[Any]) -> bool:
        messages.append(len(frames))
        return send(rid, frames)
    setattr(sender, "send_message", counting_send)
    src_free, dst_free, reserved = list(range(64)), list(range(48)), []
    try:
        # The second request's first two blocks are in the receiver's prefix cache: never written.
        for i, (num_tokens, cached_blocks) in enumerate([(40, 0), (37, 2), (1, 0)]):
            src_ids = pick_blocks(rng, src_free, num_tokens, src_block_size)
            dst_ids = pick_blocks(rng, dst_free, num_tokens, dst_block_size)
            cached = cached_blocks * dst_block_size
            reserved += dst_ids[cached_blocks:]
            dest = receiver.expect(f"r{i}", dst_ids, num_tokens, num_cached_tokens=cached)
            assert dest.shm_pool == shared_pool_of(receiver).name and dest.node_id and dest.shm_grant
            assert sender.begin(dest, src_ids) == "shm"
            send_all(sender, f"r{i}", cached, rng.randint(cached + 1, num_tokens), num_tokens)
            assert wait(sender, f"r{i}", 10).status is TransferStatus.DONE
            received = receiver.get_event(10)
            assert received is not None and received.status is TransferStatus.DONE
            got, want = token_rows(dst, dst_ids, num_tokens), token_rows(src, src_ids, num_tokens)
            assert torch.equal(got[:, :, cached:].view(torch.int16), want[:, :, cached:].view(torch.int16))
        untouched = [b for b in range(48) if b not in reserved]
        assert torch.equal(dst[:, :, untouched].view(torch.int16), before[:, :, untouched].view(torch.int16))
        assert set(messages) == {1}  # headers alone: no payload frames
        assert not receiver.dropped and receiver.num_bytes_received == sender.num_bytes_sent > 0
        assert not shared_pool_of(receiver).fence.table.any()  # every grant revoked once its request ended
    finally:
        close(sender, receiver)


@pytest.mark.parametrize("offer", ["none", "another pool", "wrong size"])
def test_in_place_headers_need_the_path_negotiated(offer):
    receiver = shared_receiver(8, 4, torch.float32, seed=3)
    pool = shared_pool_of(receiver)
    hello: dict[str, Any] = {"layout": receiver.layout.as_dict(),
             **{"none": {}, "another pool": {"shm_pool": "tandem-kv-" + "0" * 32, "shm_bytes": pool.num_bytes},
                "wrong size": {"shm_pool": pool.name, "shm_bytes": pool.num_bytes - 8}}[offer]}
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address)
    try:
        sock.send(encode(MessageKind.HELLO, **hello))
        assert sock.poll(5000)
        kind, _, reply = decode(sock.recv())
        assert kind is MessageKind.HELLO_OK and "shm_pool" not in reply  # declined
        receiver.expect("r", [5, 2], 6)
        sock.send(encode(MessageKind.LAYER, "r", layer=0, token_start=0, num_tokens=6, block_ids=[5, 2],
                         dtype="float32", row_shape=[HEADS, DIM], frame_tokens=[], in_place=True))
        deadline = time.monotonic() + 5
        while not receiver.dropped["not_negotiated"]:
            assert time.monotonic() < deadline, receiver.dropped
            time.sleep(0.01)
        assert receiver._expected["r"].received == [0] * LAYERS  # nothing counted as arrived
    finally:
        sock.close()
        close(None, receiver)


def test_the_sender_writes_only_its_reservation_in_order():
    src = random_pool(LAYERS, 8, 4, HEADS, DIM, torch.float32, seed=4)
    receiver = shared_receiver(16, 4, torch.float32, seed=5)
    sender = KVSender(src)
    dst = pool_of(receiver)
    try:
        mine = receiver.expect("mine", [3, 7], 8)
        theirs = receiver.expect("theirs", [9, 1], 8)
        sender.begin(mine, [0, 1])
        before = dst.clone()
        with pytest.raises(ValueError, match="do not follow"):  # tokens out of order within a layer
            sender.send_layer("mine", 0, 4, 8)
        assert sender.send_layer("mine", 0, 0, 4)
        with pytest.raises(ValueError, match="do not follow"):  # the same tokens again
            sender.send_layer("mine", 0, 0, 4)
        assert torch.equal(dst[:, :, [9, 1]], before[:, :, [9, 1]])
        # A destination naming another reservation's blocks under this one's grant: refused.
        forged = dataclasses.replace(theirs, request_id="forged", shm_grant=mine.shm_grant)
        sender.begin(forged, [2, 3])
        assert not sender.send_layer("forged", 0, 0, 4)
        assert wait(sender, "forged", 5).reason == "the receiver revoked its grant"
        # After the receiver aborts, its blocks are closed to the sender.
        receiver.abort("mine")
        frozen = dst.clone()
        assert not sender.send_layer("mine", 1, 0, 4)
        assert torch.equal(dst, frozen) and torch.equal(dst[:, :, [9, 1]], before[:, :, [9, 1]])
    finally:
        close(sender, receiver)


@pytest.mark.parametrize("why", ["another node", "pool not mappable", "private pool"])
def test_falls_back_to_the_socket(why):
    rng = random.Random(7)
    src = random_pool(LAYERS, 16, 4, HEADS, DIM, torch.float32, seed=6)
    receiver = (KVReceiver(random_pool(LAYERS, 16, 4, HEADS, DIM, torch.float32, 7), timeout_s=10)
                if why == "private pool" else shared_receiver(16, 4, torch.float32, seed=7))
    sender = KVSender(src, node_id="another-host/boot" if why == "another node" else None)
    try:
        if why == "pool not mappable":  # a descriptor this process does not have
            pool = receiver.shared_pool
            assert isinstance(pool, HostSharedPool)
            pool.name = f"tandem-kv-{os.getpid()}-999999-{'0' * 32}"
        src_ids, dst_ids = pick_blocks(rng, list(range(16)), 30, 4), pick_blocks(rng, list(range(16)), 30, 4)
        dest = receiver.expect("r", dst_ids, 30)
        assert sender.begin(dest, src_ids) == "zmq"
        send_all(sender, "r", 0, 13, 30)
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        assert torch.equal(token_rows(pool_of(receiver), dst_ids, 30), token_rows(src, src_ids, 30))
    finally:
        close(sender, receiver)


def test_no_room_in_shm_means_a_private_pool(monkeypatch, caplog):
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255))  # no free blocks
    monkeypatch.setattr(shared_pool_module.os, "statvfs", lambda path: full)
    assert HostSharedPool.create((LAYERS, 2, 8, 4, HEADS, DIM), torch.float32) is None
    assert "private pool, no shared-memory transfers" in caplog.text


@pytest.mark.parametrize("dst, src", [
    (("blocks", 16), ("blocks", 16)),  # scattered blocks of one size: whole blocks, odd ends by rows
    (("blocks", 4), ("blocks", 16)),  # block sizes differ: units of the smaller
    (("one run", 16), ("blocks", 16)), (("blocks", 16), ("one run", 16)),
    (("rows", 1), ("blocks", 16)),  # no common block: row by row
    (("thirds", 1), ("one run", 16)),  # a few long runs: plain copies
])
def test_row_copier_moves_each_row_to_its_slot(dst, src):
    rng = np.random.default_rng(8)
    start, end = 5, 250  # a partial first and last block

    def slots(order: str, block_size: int) -> np.ndarray:
        if order == "rows":
            return rng.permutation(320)[:end - start]
        if order == "thirds":
            return np.concatenate([np.arange(200, 300), np.arange(0, 100), np.arange(100, 145)])
        blocks = np.arange(320 // block_size)
        return token_slots(rng.permutation(blocks) if order == "blocks" else blocks, block_size, start, end)

    dst_slots, src_slots = slots(*dst), slots(*src)
    assert len(np.unique(dst_slots)) == len(dst_slots) == len(src_slots)
    src_rows, dst_rows = torch.randn(2, 320, HEADS, DIM), torch.randn(2, 320, HEADS, DIM)  # K and V
    want = dst_rows.clone()
    want[:, torch.from_numpy(dst_slots)] = src_rows[:, torch.from_numpy(src_slots)]
    row_copier(dst_slots, src_slots)(dst_rows, src_rows)
    assert torch.equal(dst_rows, want)


def test_given_rows_land_in_place():
    """A tensor-parallel prefill worker hands its gathered rows to send_layer: in place too."""
    receiver = shared_receiver(16, 4, torch.float32, seed=9)
    sender = KVSender(random_pool(LAYERS, 4, 16, HEADS, DIM, torch.float32, seed=10))
    rows = torch.randn(LAYERS, 2, 10, HEADS, DIM)
    try:
        dest = receiver.expect("r", [7, 2, 11], 10)
        assert sender.begin(dest) == "shm"
        for layer in range(LAYERS):
            assert sender.send_layer("r", layer, 0, 10, src_block_ids=[0], rows=(rows[layer, 0], rows[layer, 1]))
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        assert torch.equal(token_rows(pool_of(receiver), [7, 2, 11], 10), rows)
    finally:
        close(sender, receiver)


def test_a_pool_whose_owner_is_gone_ends_its_transfers_before_another_write():
    """The receiver goes (its pool's file closed: at a worker's death the kernel does that)
    while a transfer writes into the pool in place: the sender's next poll unmaps the pool and
    ends the transfer, so its later layers are skipped, never written through the closed fence."""
    src = random_pool(LAYERS, 8, 4, HEADS, DIM, torch.float32, seed=4)
    receiver = shared_receiver(16, 4, torch.float32, seed=5)
    sender = KVSender(src)
    try:
        sender.begin(receiver.expect("r", [3, 7], 8), [0, 1])
        assert sender.send_layer("r", 0, 0, 4)
        (peer,) = sender._peers.values()
        receiver.close()
        pool = shared_pool_of(receiver)
        # NOTE: a dead worker's descriptors all close, its pool's mapping with them; in this
        # process the mapping (kept by the tensor) holds a duplicate of the owner's descriptor,
        # so its lock is let go of as the kernel would at that death.
        ofd_unlock(pool.fence.fd, *shared_pool_module._OWNER_LOCK)
        pool.close()
        events = sender.poll()  # (its event comes once ZMQ lets go of the header frame: now or later)
        gone = "the receiver's shared pool has no owner any more"
        assert peer.lost == gone and [(e.request_id, e.reason) for e in events] in ([], [("r", gone)])
        assert not sender.send_layer("r", 1, 0, 4)  # ended: skipped, no EBADF from the fence
        assert sender.num_pending == 1 - len(events)
    finally:
        sender.close()
