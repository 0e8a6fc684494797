"""The sender's transports in one process: a gloo pair made in the handshake (what
`tandem serve --kv-transport gloo` uses; one that does not form is made again; a receiver
restarted on its old rendezvous port is joined at the first try), transports a
receiver cannot take refused, ZMQ forced past a shared pool, and the GPU path's staging
through the host (its device work faked on the CPU) sending each layer only once its copy is
done, in order."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import threading

import numpy as np
import pytest
import torch
from kv_pools import pick_blocks, random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer import dist_pairs
from tandem.kvtransfer.protocol import TransferRefused, TransferStatus
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.shared_pool import HostSharedPool
from tandem.kvtransfer.staging import Staging


def send_all(sender: KVSender, receiver: KVReceiver, rid: str, src_ids: list[int], dst_ids: list[int], n: int,
             layers: int) -> str:
    path = sender.begin(receiver.expect(rid, dst_ids, n), src_ids)
    for layer in range(layers):
        sender.send_layer(rid, layer, 0, n // 2)
        sender.send_layer(rid, layer, n // 2)
    return path


def test_gloo_pair_round_trip():
    rng = random.Random(3)
    src = random_pool(3, 32, 16, 2, 8, torch.bfloat16, seed=1)
    dst = random_pool(3, 40, 4, 2, 8, torch.bfloat16, seed=2)
    receiver = KVReceiver(dst, timeout_s=10)
    sender = KVSender(src, timeout_s=10, transport="gloo")
    src_free, dst_free = list(range(32)), list(range(40))
    try:
        for i, n in enumerate([2, 17, 40]):
            src_ids, dst_ids = pick_blocks(rng, src_free, n, 16), pick_blocks(rng, dst_free, n, 4)
            assert send_all(sender, receiver, f"r{i}", src_ids, dst_ids, n, 3) == "dist"
            assert wait(sender, f"r{i}", 10).status is TransferStatus.DONE
            received = receiver.get_event(10)
            assert received is not None and received.status is TransferStatus.DONE
            assert torch.equal(token_rows(dst, dst_ids, n), token_rows(src, src_ids, n))
        assert not receiver.dropped and sender.num_bytes_sent == receiver.num_bytes_received > 0
    finally:
        sender.close()
        receiver.close()


def test_a_pair_that_does_not_form_is_made_again(monkeypatch, caplog):
    """The sender's side of the first pair fails to join (as a gloo connect that timed out on a
    loaded host): the sender shakes hands once more, and the second pair carries the KV."""
    gloo = dist_pairs.PAIR_BACKENDS["gloo"]
    joins = []

    def build(store, rank, timeout, host):
        joins.append(rank)
        if joins.count(dist_pairs.SENDER_RANK) == 1 and rank == dist_pairs.SENDER_RANK:
            raise RuntimeError("Gloo connectFullMesh failed: timed out")
        return gloo.build(store, rank, timeout, host)

    monkeypatch.setitem(dist_pairs.PAIR_BACKENDS, "gloo", dataclasses.replace(gloo, build=build))
    src = random_pool(2, 8, 16, 2, 8, torch.float32, seed=5)
    dst = random_pool(2, 8, 16, 2, 8, torch.float32, seed=6)
    receiver = KVReceiver(dst, timeout_s=2)
    sender = KVSender(src, timeout_s=2, transport="gloo")
    try:
        with caplog.at_level("WARNING"):
            assert send_all(sender, receiver, "r", [3], [4], 10, 2) == "dist"
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        assert torch.equal(token_rows(dst, [4], 10), token_rows(src, [3], 10))
        assert "no torch.distributed pair" in caplog.text and "shaking hands again" in caplog.text
        assert joins.count(dist_pairs.SENDER_RANK) == 2
    finally:
        sender.close()
        receiver.close()


def test_a_receiver_restarted_on_its_old_store_port(monkeypatch):
    """A sender keeps its connection to each receiver's rendezvous store across pairs. When a
    receiver is gone and a new one's store listens on its old port, the kept connection is
    broken; the join still succeeds at the first try, on a fresh connection."""
    address, timeout_s = "tcp://127.0.0.1:5555", 5.0

    def pair_round_trip(receiver: dist_pairs.ReceiverPairs, offer: dict) -> None:
        mine = dist_pairs.join_pair(address, offer, timeout_s)
        theirs = receiver.payload(b"prefill")
        rows = torch.arange(12, dtype=torch.float32).reshape(3, 2, 2)
        got: list[torch.Tensor] = []
        t = threading.Thread(target=lambda: got.extend(theirs.recv(dist_pairs.SENDER_RANK, 3, (2, 2), "float32")))
        t.start()
        mine.send(dist_pairs.RECEIVER_RANK, rows, rows + 1)
        t.join(timeout_s)
        assert len(got) == 2 and torch.equal(got[0], rows) and torch.equal(got[1], rows + 1)
        mine.close()

    gone = dist_pairs.ReceiverPairs(address, timeout_s)
    offer = gone.offer(b"prefill", "gloo")
    pair_round_trip(gone, offer)
    kept = dist_pairs._RENDEZVOUS._clients[("127.0.0.1", offer["store_port"], timeout_s)]
    gone.close()
    del gone
    gc.collect()  # (its store's server stops with its last reference)
    restarted = dist_pairs.ReceiverPairs(address, timeout_s)
    try:
        offer = restarted.offer(b"prefill", "gloo")
        # The kept connection under the new store's port, as it is once the kernel hands a
        # new receiver the old port (it frees it only a minute after: not waited for here).
        monkeypatch.setitem(dist_pairs._RENDEZVOUS._clients,
                            ("127.0.0.1", offer["store_port"], timeout_s), kept)
        pair_round_trip(restarted, offer)
    finally:
        restarted.close()


def test_nccl_refused_for_a_pool_in_host_memory():
    receiver = KVReceiver(random_pool(2, 8, 16, 2, 8, torch.float32, seed=0), timeout_s=10)
    sender = KVSender(random_pool(2, 8, 16, 2, 8, torch.float32, seed=0), transport="nccl")
    try:
        with pytest.raises(TransferRefused, match="NCCL"):
            sender.begin(receiver.expect("r", [0], 3), [0])
        assert sender.num_pending == 0
    finally:
        sender.close()
        receiver.close()


def test_zmq_forced_past_a_shared_pool():
    pool = HostSharedPool.create((2, 2, 8, 16, 2, 8), torch.float32)
    if pool is None:
        pytest.skip("no room for a pool in /dev/shm")
    receiver = KVReceiver(pool.kv_cache, timeout_s=10, shared_pool=pool)
    src = random_pool(2, 8, 16, 2, 8, torch.float32, seed=4)
    try:
        for transport, want in (("zmq", "zmq"), ("auto", "shm")):
            sender = KVSender(src, timeout_s=10, transport=transport)
            try:
                assert send_all(sender, receiver, transport, [1], [2], 9, 2) == want
                assert wait(sender, transport, 10).status is TransferStatus.DONE
            finally:
                sender.close()
            assert torch.equal(token_rows(pool.kv_cache, [2], 9), token_rows(src, [1], 9))
    finally:
        receiver.close()
        pool.close()


class HeldCopies:
    """DeviceOps on the CPU whose copies finish only when the test says so."""

    def __init__(self) -> None:
        self.done = 0
        self.started = 0

    def side(self):
        return contextlib.nullcontext()

    def upload(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))

    def download(self, rows: torch.Tensor):
        k = self.started
        self.started += 1
        return rows.clone(), lambda: k < self.done


def test_staged_layers_go_out_once_copied_in_order():
    src = random_pool(3, 16, 16, 2, 8, torch.float16, seed=5)
    dst = random_pool(3, 16, 16, 2, 8, torch.float16, seed=6)
    receiver = KVReceiver(dst, timeout_s=10)
    sender = KVSender(src, timeout_s=10, transport="zmq", checksum=True)
    ops = HeldCopies()
    sender.staging = Staging(ops)  # what a pool on a GPU gets
    try:
        send_all(sender, receiver, "r", [3, 7], [9, 1], 20, 3)
        assert ops.started == 6 and sender.num_bytes_sent == 0  # nothing left before its copy finished
        assert sender.poll() == []
        ops.done = 5
        sender.poll()
        assert receiver.get_event(0.5) is None  # the last layer is still on its way
        ops.done = 6
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        received = receiver.get_event(10)
        assert received is not None and received.status is TransferStatus.DONE
        assert torch.equal(token_rows(dst, [9, 1], 20), token_rows(src, [3, 7], 20))
        # An aborted request's staged layers are dropped, and its blocks held until they are copied.
        sender.begin(receiver.expect("a", [4], 5), [2])
        sender.send_layer("a", 0)
        sender.abort("a")
        assert sender.poll() == [] and sender.num_pending == 1
        ops.done = 7
        assert [e.request_id for e in sender.poll()] == ["a"]
        assert not receiver.dropped
    finally:
        sender.close()
        receiver.close()


def test_serve_takes_every_transport_and_no_other():
    import argparse

    from tandem.kvtransfer.connectors.registry import kv_transports
    from tandem.router import serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    assert parser.parse_args([]).kv_transport == "auto"
    assert [parser.parse_args(["--kv-transport", t]).kv_transport for t in kv_transports()] == list(kv_transports())
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "rdma"])
    with pytest.raises(ValueError, match="transport"):
        KVSender(random_pool(1, 2, 4, 1, 4, torch.float32, seed=0), transport="rdma")
