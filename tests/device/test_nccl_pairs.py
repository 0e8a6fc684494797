"""KV pairs (dist_pairs.py) made by NCCL's rules, with the fake backend in NCCL's place
(fake_nccl.py): one rank per device, every pair's communicator destroyed when its peer closes
or is forgotten (a reconnect storm leaves as many as there are live pairs), and, with
$TANDEM_KV_SECRET set, no joiner without the grant's proof."""

from __future__ import annotations

import threading
import time

import fake_nccl
import pytest
import torch
import zmq

from tandem.kvtransfer import dist_pairs
from tandem.kvtransfer.connectors.dist_pair import DistSend
from tandem.kvtransfer.curve import SECRET_ENV
from tandem.kvtransfer.pair_grant import PairRefused
from tandem.kvtransfer.payload import DistPayload
from tandem.kvtransfer.peer import Peer
from tandem.kvtransfer.protocol import KVLayout

ADDRESS = "tcp://127.0.0.1:5555"  # the receiver's ZMQ address: only its host is used here
TIMEOUT_S = 2.0
ROW_SHAPE = (3, 64)  # the default model's KV heads and head_dim


@pytest.fixture
def pairs(monkeypatch):
    """ReceiverPairs with the fake in NCCL's place; the senders' thread on device 1 (the
    receiver's pair threads are on device 0, as two workers on two GPUs)."""
    monkeypatch.setitem(dist_pairs.PAIR_BACKENDS, "nccl", fake_nccl.PAIR)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    fake_nccl.set_device(1)
    before = fake_nccl.live_communicators()
    receiver = dist_pairs.ReceiverPairs(ADDRESS, TIMEOUT_S)
    yield receiver, before
    receiver.close()
    fake_nccl.set_device(0)


def join(receiver: dist_pairs.ReceiverPairs, sender: bytes) -> tuple[DistPayload, DistPayload]:
    """-> (the sender's side, the receiver's side) of a new pair."""
    offer = receiver.offer(sender, "nccl")
    mine = dist_pairs.join_pair(ADDRESS, offer, TIMEOUT_S)
    return mine, receiver.payload(sender)


def send_recv(mine: DistPayload, theirs: DistPayload) -> torch.Tensor:
    """One layer's K and V at the default model's shapes, sender to receiver."""
    k = fake_nccl.empty(5, *ROW_SHAPE, dtype=torch.bfloat16, device=mine.device)
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.extend(theirs.recv(0, 5, ROW_SHAPE, "bfloat16")))
    t.start()
    mine.send(dist_pairs.RECEIVER_RANK, k, k)
    t.join(TIMEOUT_S)
    assert len(got) == 2
    return got[0]


def wait_until(condition, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_one_rank_per_device(pairs):
    receiver, before = pairs
    fake_nccl.set_device(0)  # the sender on the receiver's device
    offer = receiver.offer(b"same-gpu", "nccl")
    with pytest.raises(RuntimeError, match="Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000"):
        dist_pairs.join_pair(ADDRESS, offer, TIMEOUT_S)
    with pytest.raises(RuntimeError, match="ncclInvalidUsage[^$]*Duplicate GPU detected : rank 1 and rank 0"):
        receiver.payload(b"same-gpu")
    assert fake_nccl.live_communicators() == before
    fake_nccl.set_device(1)
    mine, theirs = join(receiver, b"other-gpu")
    assert send_recv(mine, theirs).device == torch.device("cuda", 0) and mine.device == torch.device("cuda", 1)
    mine.close()


def test_reconnect_storm_leaves_only_live_pairs(pairs):
    """100 handshakes: half a sender shaking hands again under its identity (the receiver
    forgets the old pair), half a new connection each after the old one closed (Peer.close);
    then exactly the live pair's two communicators are left."""
    receiver, before = pairs
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    layout = KVLayout(30, 8, 16, *ROW_SHAPE, "bfloat16")
    for i in range(100):
        mine, _ = join(receiver, b"again" if i % 2 else f"new-{i}".encode())
        Peer(context.socket(zmq.DEALER), layout, DistSend(mine)).close()
        del mine
    live, theirs = join(receiver, b"live")
    # (a closed sender's word reaches the receiver on a thread of its own, then its next handshake)
    assert wait_until(lambda: fake_nccl.live_communicators() - before <= 3), \
        f"{fake_nccl.live_communicators() - before} communicators live for 1 live pair"
    receiver.offer(b"probe", "nccl")  # the next handshake: the receiver drops what was closed
    receiver.forget(b"probe")
    assert wait_until(lambda: fake_nccl.live_communicators() - before == 2), fake_nccl.live_communicators() - before
    assert send_recv(live, theirs).shape == (5, *ROW_SHAPE)
    live.close()
    receiver.forget(b"live")
    assert wait_until(lambda: fake_nccl.live_communicators() == before)


def test_rendezvous_refuses_a_joiner_without_the_grant(pairs, monkeypatch):
    receiver, before = pairs
    for joiner_secret in ("not-the-secret", ""):
        monkeypatch.setenv(SECRET_ENV, "the-secret")
        offer = receiver.offer(b"intruder", "nccl")
        monkeypatch.setenv(SECRET_ENV, joiner_secret)
        with pytest.raises(RuntimeError):  # the receiver never joins: the sender's rendezvous times out
            dist_pairs.join_pair(ADDRESS, offer, 0.5)
        with pytest.raises(PairRefused, match="wrong" if joiner_secret else "no grant proof"):
            receiver.payload(b"intruder")
        assert fake_nccl.live_communicators() == before, "a group was made with a joiner that has no grant"
    monkeypatch.setenv(SECRET_ENV, "the-secret")
    mine, theirs = join(receiver, b"granted")
    assert send_recv(mine, theirs).dtype == torch.bfloat16
    mine.close()
