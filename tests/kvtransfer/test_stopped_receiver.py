"""A receiver that stops reading (a SIGSTOPped or vanished decode worker) cannot pin the
sender's blocks: frames ZMQ still queues for it after their request ended are dropped with
its socket, so the request's blocks are the prefill worker's again within the grace."""

from __future__ import annotations

import threading
import time

import torch
import zmq
from kv_pools import random_pool

from tandem.kvtransfer import sender as sender_module
from tandem.kvtransfer.protocol import Destination, KVLayout, MessageKind, TransferEvent, TransferStatus, encode
from tandem.kvtransfer.sender import KVSender

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 24, 64, 16, 8, 64  # a layer of 1024 tokens: 2 MiB of K


def test_a_receiver_that_stops_reading_cannot_pin_the_blocks():
    src = random_pool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, seed=5)
    layout = KVLayout(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, "float32")
    stopped: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    stopped.setsockopt(zmq.LINGER, 0)
    stopped.setsockopt(zmq.RCVHWM, 1)  # it takes one message in, and then reads nothing more
    stopped.setsockopt(zmq.RCVBUF, 65536)
    port = stopped.bind_to_random_port("tcp://127.0.0.1")
    sender = KVSender(src, timeout_s=30)
    try:
        address = f"tcp://127.0.0.1:{port}"

        def answer_hello() -> None:
            assert stopped.poll(5000)
            identity, _ = stopped.recv_multipart()
            stopped.send_multipart([identity, encode(MessageKind.HELLO_OK, layout=layout.as_dict())])
        answering = threading.Thread(target=answer_hello)
        answering.start()
        sender.connect(address)
        answering.join()
        num_tokens = BLOCKS * BLOCK_SIZE
        sender.begin(Destination("r", address, tuple(range(BLOCKS)), num_tokens), list(range(BLOCKS)))
        for layer in range(LAYERS):
            assert sender.send_layer("r", layer)
        sender.abort("r")  # the request ends (as at its timeout): ZMQ still holds most of its frames
        ended = time.monotonic()
        assert sender.poll() == [] and sender.num_pending == 1  # pinned: not reported while ZMQ reads them
        events: list[TransferEvent] = []
        while not events:
            assert time.monotonic() - ended < sender_module.RELEASE_GRACE_S + 5, "the blocks stay pinned"
            events = sender.poll()
            time.sleep(0.01)
        released_s = time.monotonic() - ended
        assert [(e.request_id, e.status) for e in events] == [("r", TransferStatus.FAILED)]
        assert sender.num_pending == 0 and sender_module.RELEASE_GRACE_S <= released_s
    finally:
        sender.close()
        stopped.close()
