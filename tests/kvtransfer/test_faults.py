"""Bad input and faults: each bad message is dropped with a counter, the connection and the
pool stay usable, nothing is written outside the request's own blocks; aborts and
timeouts end a transfer on both sides."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq
from kv_pools import pair, random_pool, token_rows
from raw_sender import BLOCKS, DIM, DST_BLOCKS, HEADS, LAYERS, NUM_TOKENS, RawSender
from sender_wait import wait

from tandem.kvtransfer.protocol import MessageKind, TransferStatus
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender


def wait_dropped(receiver: KVReceiver, reason: str) -> None:
    deadline = time.monotonic() + 5
    while receiver.dropped[reason] == 0:
        assert time.monotonic() < deadline, f"never dropped for {reason}: {receiver.dropped}"
        time.sleep(0.005)


BAD_MESSAGES = {
    "malformed": lambda s: (b"\xc1 not msgpack", s.frames()),
    "version": lambda s: (msgpack.packb({"v": 99, "kind": 4, "request_id": "req"}), s.frames()),
    "unknown_request": lambda s: (s.header(), s.frames(), "nobody"),
    "wrong_dtype": lambda s: (s.header(dtype="float16"), s.frames()),
    "wrong_shape": lambda s: (s.header(row_shape=[HEADS * 2, DIM // 2]), s.frames()),
    "truncated": lambda s: (s.header(), [s.frames()[0], bytes(len(s.frames()[1]) - 4)]),
    "block_out_of_range": lambda s: (s.header(block_ids=[5, BLOCKS]), s.frames()),
    "foreign_block": lambda s: (s.header(block_ids=[5, 3]), s.frames()),
    "layer_out_of_range": lambda s: (s.header(layer=LAYERS), s.frames()),
    "bad_token_range": lambda s: (s.header(token_start=4, num_tokens=4, frame_tokens=[4]),
                                  [f[:4 * HEADS * DIM * 4] for f in s.frames()]),
}


@pytest.mark.parametrize("reason", list(BAD_MESSAGES))
def test_bad_message_is_dropped_and_the_connection_stays_usable(receiver, reason):
    before = receiver.kv_cache.clone()
    dest = receiver.expect("req", DST_BLOCKS, NUM_TOKENS)
    raw = RawSender(receiver)
    raw.handed(dest)
    header, frames, *request_id = BAD_MESSAGES[reason](raw)
    raw.send(header, frames, *request_id)
    wait_dropped(receiver, reason)
    assert torch.equal(receiver.kv_cache, before), "a dropped message wrote into the pool"
    # The same connection then completes the request, and only its blocks change.
    raw.send_all_layers()
    assert raw.next_kind() is MessageKind.DONE
    received = receiver.get_event(5)
    assert received is not None and received.status is TransferStatus.DONE
    assert torch.equal(token_rows(receiver.kv_cache, DST_BLOCKS, NUM_TOKENS), token_rows(raw.src, [0], NUM_TOKENS))
    others = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    assert torch.equal(receiver.kv_cache[:, :, others], before[:, :, others])


def test_duplicate_layer_is_dropped_and_keeps_the_first(receiver):
    dest = receiver.expect("req", DST_BLOCKS, NUM_TOKENS)
    raw = RawSender(receiver)
    raw.handed(dest)
    raw.send(raw.header(layer=0), raw.frames(0))
    raw.send(raw.header(layer=0), raw.frames(1))  # layer 0 again, with other bytes
    wait_dropped(receiver, "duplicate_layer")
    raw.send(raw.header(layer=1), raw.frames(1))
    assert raw.next_kind() is MessageKind.DONE
    assert torch.equal(token_rows(receiver.kv_cache, DST_BLOCKS, NUM_TOKENS), token_rows(raw.src, [0], NUM_TOKENS))


def test_receiver_abort_stops_the_sender_and_late_layers_write_nothing(receiver):
    dest = receiver.expect("req", DST_BLOCKS, NUM_TOKENS)
    raw = RawSender(receiver)
    raw.handed(dest)
    raw.send(raw.header(layer=0), raw.frames(0))
    deadline = time.monotonic() + 5
    while receiver._expected["req"].received[0] == 0:  # layer 0 written
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert receiver.abort("req")
    assert raw.next_kind() is MessageKind.ABORT  # the sender is told at once
    after_abort = receiver.kv_cache.clone()
    raw.send(raw.header(layer=1), raw.frames(1))  # a layer already in flight
    assert raw.next_kind() is MessageKind.ABORT
    wait_dropped(receiver, "ended_request")  # counted just after the ABORT reply goes out
    assert receiver.dropped["ended_request"] == 1
    assert torch.equal(receiver.kv_cache, after_abort)
    assert receiver.get_event(0.2) is None and receiver.num_pending == 0


def test_abort_from_the_sender_fails_the_request_on_the_receiver():
    src, dst = random_pool(2, 4, 16, 1, 4, torch.float32, 1), random_pool(2, 4, 16, 1, 4, torch.float32, 2)
    sender, receiver = pair(src, dst)
    try:
        sender.begin(receiver.expect("req", [1], 10), [3])
        sender.send_layer("req", 0)
        assert sender.abort("req")
        assert not sender.send_layer("req", 1)  # nothing more goes out
        # The owner gets its blocks back once ZMQ has let go of the frames read from them.
        assert wait(sender, "req", 5).reason == "aborted by the sender" and sender.num_pending == 0
        event = receiver.get_event(5)
        assert event is not None
        assert (event.request_id, event.status) == ("req", TransferStatus.FAILED)
        assert "sender" in event.reason and receiver.num_pending == 0
    finally:
        sender.close()
        receiver.close()


def test_receiver_abort_reaches_the_sender_as_failed():
    src, dst = random_pool(2, 4, 16, 1, 4, torch.float32, 1), random_pool(2, 4, 16, 1, 4, torch.float32, 2)
    sender, receiver = pair(src, dst)
    try:
        sender.begin(receiver.expect("req", [1], 10), [3])
        sender.send_layer("req", 0)
        deadline = time.monotonic() + 5
        while receiver._expected["req"].sender is None:  # the receiver knows whom to tell
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert receiver.abort("req")
        event = wait(sender, "req", 5)
        assert event.status is TransferStatus.FAILED and sender.num_pending == 0
    finally:
        sender.close()
        receiver.close()


def test_a_transfer_that_stalls_times_out_on_both_sides(fault_report):
    """Layer 1 never comes: the receiver's sweep fails it with no further traffic, and the
    sender, never acked, fails it too."""
    src, dst = random_pool(2, 4, 16, 1, 4, torch.float32, 1), random_pool(2, 4, 16, 1, 4, torch.float32, 2)
    receiver = KVReceiver(dst, timeout_s=0.3)
    sender = KVSender(src, timeout_s=0.6)
    try:
        sender.begin(receiver.expect("req", [1], 10), [3])
        sender.send_layer("req", 0)
        start = time.monotonic()
        event = receiver.get_event(5)
        assert event is not None
        assert event.status is TransferStatus.FAILED and "timed out" in event.reason
        receiver_s = time.monotonic() - start
        assert receiver_s < 2 and receiver.num_pending == 0
        assert wait(sender, "req", 5).status is TransferStatus.FAILED and sender.num_pending == 0
        sender_s = time.monotonic() - start
    finally:
        sender.close()
        receiver.close()
    fault_report.add("KV transfer stalled after layer 0", injected=1, affected=1, clear=1,
                     leaked=receiver.num_pending + sender.num_pending, recovery_s=None,
                     note=f"the receiver failed it {receiver_s:.2f} s into the stall (its timeout: 0.3 s), the sender "
                          f"{sender_s:.2f} s (told by the receiver before its own 0.6 s), with no other traffic")


def test_waiting_before_the_first_layer_is_never_timed():
    """A prompt that waits in the prefill queue past both timeouts after begin/expect, then
    runs: its transfer completes, bytes exact. The clocks run from the latest layer."""
    src, dst = random_pool(2, 4, 16, 1, 4, torch.float32, 1), random_pool(2, 4, 16, 1, 4, torch.float32, 2)
    receiver = KVReceiver(dst, timeout_s=0.3)
    sender = KVSender(src, timeout_s=0.3)
    try:
        sender.begin(receiver.expect("req", [1], 10), [3])
        time.sleep(1.0)  # three timeouts' worth of queueing; the receiver's sweep runs meanwhile
        assert sender.poll() == [] and receiver.get_event(0) is None
        assert receiver.num_pending == 1 and sender.num_pending == 1
        assert all(sender.send_layer("req", layer) for layer in range(2))
        received = receiver.get_event(5)
        assert received is not None and received.status is TransferStatus.DONE
        assert wait(sender, "req", 5).status is TransferStatus.DONE
        assert torch.equal(token_rows(dst, [1], 10), token_rows(src, [3], 10))
    finally:
        sender.close()
        receiver.close()


def test_kv_due_once_all_of_it_was_sent(receiver):
    """The first token came, so the sender sent every layer: KV that never lands (a sender
    that died with its layers queued) fails within the timeout though no layer arrived."""
    receiver.expect("req", DST_BLOCKS, NUM_TOKENS, timeout_s=0.3)
    time.sleep(0.5)
    assert receiver.get_event(0) is None  # not yet due: the prompt may still be queued
    receiver.all_sent("req")
    event = receiver.get_event(5)
    assert event is not None
    assert (event.request_id, event.status) == ("req", TransferStatus.FAILED)
    assert receiver.num_pending == 0 and receiver.dropped["timeout"] == 1


def test_sender_gives_up_on_a_receiver_that_never_answers():
    sender = KVSender(random_pool(2, 4, 16, 1, 4, torch.float32, 1))
    dead: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)  # bound, but nobody reads it
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TimeoutError, match="no KV receiver answered"):
            sender.connect(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
    finally:
        dead.close(linger=0)
        sender.close()
