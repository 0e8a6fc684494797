"""Peers agree on the model at the handshake, and an optional checksum catches KV
corrupted in transit: that request fails with a clear reason, the rest go on."""

from __future__ import annotations

import time

import pytest
import torch
from kv_pools import random_pool, token_rows
from raw_sender import BLOCK_SIZE, BLOCKS, DIM, DST_BLOCKS, HEADS, LAYERS, NUM_TOKENS, RawSender
from sender_wait import wait

from tandem.kvtransfer.protocol import MessageKind, TransferRefused, TransferStatus, payload_crc32
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender

SRC_BLOCKS = [1, 0]


def make_pair(sender_model: str | None, receiver_model: str | None, checksum: bool = False):
    src = random_pool(LAYERS, 2, 8, HEADS, DIM, torch.float32, seed=11)
    dst = random_pool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, seed=12)
    receiver = KVReceiver(dst, timeout_s=10, model=receiver_model)
    return KVSender(src, timeout_s=10, model=sender_model, checksum=checksum), receiver


def send(sender: KVSender, receiver: KVReceiver, request_id: str):
    dest = receiver.expect(request_id, DST_BLOCKS, NUM_TOKENS)
    sender.begin(dest, SRC_BLOCKS)
    for layer in range(LAYERS):
        assert sender.send_layer(request_id, layer)
    return wait(sender, request_id, 10), receiver.get_event(10)


@pytest.mark.parametrize("sender_model", ["SmolLM2:other", None])
def test_a_different_model_is_refused_at_the_handshake(sender_model):
    sender, receiver = make_pair(sender_model, "SmolLM2:abc")
    try:
        with pytest.raises(TransferRefused, match="model differs: receiver serves 'SmolLM2:abc'"):
            sender.connect(receiver.address)
        assert receiver.num_pending == 0
    finally:
        sender.close()
        receiver.close()


def test_the_same_model_with_checksums_round_trips():
    sender, receiver = make_pair("m:1", "m:1", checksum=True)
    try:
        sent, received = send(sender, receiver, "ok")
        assert sent.status is received.status is TransferStatus.DONE
        assert torch.equal(token_rows(receiver.kv_cache, DST_BLOCKS, NUM_TOKENS),
                           token_rows(sender.kv_cache, SRC_BLOCKS, NUM_TOKENS))
        assert not receiver.dropped
    finally:
        sender.close()
        receiver.close()


def test_a_corrupted_layer_fails_only_its_request(fault_report):
    receiver = KVReceiver(random_pool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, seed=3), timeout_s=10)
    try:
        raw = RawSender(receiver)
        raw.handed(receiver.expect("bad", DST_BLOCKS, NUM_TOKENS))
        frames = raw.frames(0)
        good_crc = payload_crc32(frames)
        corrupted = [bytearray(f) for f in frames]
        corrupted[1][5] ^= 0x40  # one bit flipped in V
        raw.send(raw.header("bad", 0, crc32=good_crc), [bytes(f) for f in corrupted], "bad")
        assert raw.next_kind() is MessageKind.FAILED
        event = receiver.get_event(5)
        assert event is not None
        assert (event.request_id, event.status) == ("bad", TransferStatus.FAILED) and "checksum" in event.reason
        # (counted on the receiver's I/O thread just after it failed the request and told both)
        deadline = time.monotonic() + 5
        while receiver.dropped["checksum"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.dropped["checksum"] == 1 and receiver.num_pending == 0
        # The receiver goes on: the next request, checksummed and intact, completes.
        raw.handed(receiver.expect("next", DST_BLOCKS, NUM_TOKENS))
        for layer in range(LAYERS):
            raw.send(raw.header("next", layer, crc32=payload_crc32(raw.frames(layer))), raw.frames(layer), "next")
        assert raw.next_kind() is MessageKind.DONE
        received = receiver.get_event(5)
        assert received is not None and received.status is TransferStatus.DONE
    finally:
        receiver.close()
    fault_report.add("KV corrupted in flight (one bit, CRC-32 on)", injected=1, affected=1, clear=1,
                     leaked=receiver.num_pending,
                     recovery_s=None, note="its transfer FAILED naming the checksum; the next one on the same "
                                           "connection completed")
