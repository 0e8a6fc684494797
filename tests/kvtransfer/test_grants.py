"""Only the peer the router chose writes a request's KV: LAYER and ABORT messages must carry
the reservation's grant, and no peer can make the receiver buffer a frame larger than any
layer it could take."""

from __future__ import annotations

import time

import torch
import zmq
from kv_pools import token_rows
from raw_sender import DST_BLOCKS, LAYERS, NUM_TOKENS, RawSender
from zmq.utils.monitor import recv_monitor_message

from tandem.kvtransfer.protocol import MessageKind, TransferStatus, encode


def test_messages_without_the_grant_write_and_end_nothing(receiver):
    before = receiver.kv_cache.clone()
    dest = receiver.expect("req", DST_BLOCKS, NUM_TOKENS)
    chosen, forger = RawSender(receiver), RawSender(receiver, dtype=torch.float32)
    chosen.handed(dest)
    forger.grants["req"] = "00" * 16  # a guess
    for layer in range(LAYERS):
        forger.send(forger.header("req", layer), forger.frames(layer))
    # A corrupt layer and an ABORT: neither may fail the request for the one it belongs to.
    forger.send(forger.header("req", 0, crc32=1), forger.frames(0))
    forger.grants["req"] = ""
    forger.send(forger.header("req", 1), forger.frames(1))
    forger.socket.send(encode(MessageKind.ABORT, "req"))
    deadline = time.monotonic() + 5
    while receiver.dropped.total() < LAYERS + 3:
        assert time.monotonic() < deadline, receiver.dropped
        time.sleep(0.005)
    # (The corrupt one is dropped for its checksum, yet fails nothing without the grant.)
    assert receiver.dropped == {"no_grant": LAYERS + 2, "checksum": 1}, receiver.dropped
    assert torch.equal(receiver.kv_cache, before) and receiver.get_event(0) is None and receiver.num_pending == 1
    chosen.send_all_layers()
    assert chosen.next_kind() is MessageKind.DONE
    assert receiver.get_event(5).status is TransferStatus.DONE
    assert torch.equal(token_rows(receiver.kv_cache, DST_BLOCKS, NUM_TOKENS), token_rows(chosen.src, [0], NUM_TOKENS))


def test_an_oversized_frame_disconnects_its_sender_before_it_is_buffered(receiver):
    dest = receiver.expect("req", DST_BLOCKS, NUM_TOKENS)
    forger = RawSender(receiver)
    forger.handed(dest)  # even the chosen sender may not send more than a layer can hold
    monitor = forger.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        forger.send(forger.header("req", 0), [bytes(receiver.max_frame_bytes + 1), bytes(8)])
        assert monitor.poll(5000), "the receiver kept the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        forger.socket.disable_monitor()
        monitor.close(linger=0)
    assert not receiver.dropped and receiver.num_pending == 1  # it never reached the receiver's code
    chosen = RawSender(receiver)
    chosen.handed(dest)
    chosen.send_all_layers()
    assert chosen.next_kind() is MessageKind.DONE
