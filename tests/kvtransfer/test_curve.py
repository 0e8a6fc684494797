"""CurveZMQ on the KV sockets (kvtransfer/curve.py): with the cluster's secret on both sides
the KV arrives exact and never crosses the wire in clear; a sender without the secret, or
with another one, gets no handshake and writes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_pools import random_pool, token_rows
from sender_wait import wait
from tcp_tap import TcpTap

from tandem.kvtransfer.curve import SECRET_ENV, CurveKeys
from tandem.kvtransfer.protocol import TransferStatus
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender

SECRET = "a-cluster-secret-of-some-length"
KEYS = CurveKeys.from_secret(SECRET)
BLOCK_IDS = [3, 0, 5]


def send_through_tap(curve: CurveKeys | None) -> tuple[TcpTap, torch.Tensor, torch.Tensor]:
    """One request's KV from a sender to a receiver through a tap. -> (tap, sent rows, received rows)."""
    src = random_pool(2, 8, 4, 2, 8, torch.float32, seed=1)
    dst = random_pool(2, 8, 4, 2, 8, torch.float32, seed=2)
    receiver = KVReceiver(dst, timeout_s=10, curve=curve)
    tap = TcpTap(receiver.address.removeprefix("tcp://"))
    sender = KVSender(src, timeout_s=10, curve=curve)
    try:
        dest = receiver.expect("r", BLOCK_IDS, 10)
        sender.begin(dataclasses.replace(dest, address=tap.address), [1, 2, 4])
        for layer in range(2):
            sender.send_layer("r", layer)
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        received = receiver.get_event(10)
        assert received is not None and received.status is TransferStatus.DONE
        return tap, token_rows(src, [1, 2, 4], 10), token_rows(dst, BLOCK_IDS, 10)
    finally:
        sender.close()
        receiver.close()
        tap.close()


@pytest.mark.parametrize("curve", [None, KEYS], ids=["plain", "curve"])
def test_the_kv_crosses_the_wire_in_clear_only_without_curve(curve):
    tap, sent, received = send_through_tap(curve)
    assert torch.equal(received, sent)
    some_rows = sent[1, 1, 3:5].numpy().tobytes()  # 128 bytes of layer 1's V
    assert tap.saw(some_rows) is (curve is None)


OTHER = CurveKeys.from_secret("another-secret-entirely")
# Knows the receivers' public key (a public key may leak) but has no client key of the cluster.
KNOWS_THE_SERVER = dataclasses.replace(OTHER, server_public=KEYS.server_public)


@pytest.mark.parametrize("sender_curve", [None, OTHER, KNOWS_THE_SERVER],
                         ids=["no secret", "another secret", "the server key alone"])
def test_a_sender_without_the_secret_gets_no_handshake(sender_curve):
    dst = random_pool(2, 8, 4, 2, 8, torch.float32, seed=2)
    before = dst.clone()
    receiver = KVReceiver(dst, timeout_s=10, curve=KEYS)
    stranger = KVSender(random_pool(2, 8, 4, 2, 8, torch.float32, seed=1), curve=sender_curve)
    member = KVSender(random_pool(2, 8, 4, 2, 8, torch.float32, seed=1), curve=KEYS)
    try:
        with pytest.raises(TimeoutError, match="no KV receiver"):
            stranger.connect(receiver.address, timeout_s=1)
        assert torch.equal(dst, before)
        # Only a handshake to the right server key gets as far as the ZAP handler, which refuses it.
        assert (receiver.dropped["unauthenticated"] >= 1) is (sender_curve is KNOWS_THE_SERVER)
        assert member.connect(receiver.address).block_size == 4  # the cluster's senders still get in
    finally:
        stranger.close()
        member.close()
        receiver.close()


def test_keys_come_from_the_secret_alone(monkeypatch):
    assert CurveKeys.from_secret(SECRET) == KEYS
    other = CurveKeys.from_secret(SECRET + "!")
    assert {other.server_public, other.client_public}.isdisjoint({KEYS.server_public, KEYS.client_public})
    assert KEYS.server_public != KEYS.client_public
    with pytest.raises(ValueError, match="at least 16"):
        CurveKeys.from_secret("short")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert CurveKeys.from_env() is None
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert CurveKeys.from_env() == KEYS
