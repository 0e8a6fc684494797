"""A peer that is not the prefill worker the router chose, on a real cluster: its KV for a
decode worker's reservation is dropped without the grant, an oversized frame gets it
disconnected before it is buffered, and the decode worker serves on with nothing leaked."""

from __future__ import annotations

import uuid

import msgpack
import pytest
import torch
import zmq
from fault_calls import assert_serves, awaited, wait_until
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import assert_workers_empty, num_leaked_blocks
from zmq.utils.monitor import recv_monitor_message

from tandem.kvtransfer.protocol import MAX_HEADER_BYTES, MessageKind, encode
from tandem.model.fingerprint import model_fingerprint
from tandem.model.loader import load_model
from tandem.model.source import resolve_model_source
from tandem.sampling_params import SamplingParams
from tandem.worker.api import WorkerRequest

pytestmark = pytest.mark.slow


def _dropped(cluster, worker, reason: str) -> float:
    text = cluster.run(awaited(worker.handle.metrics_text.remote()))
    return total(parse_samples(text), "tandem_kv_messages_dropped_total", reason=reason)


def test_kv_from_a_peer_without_the_grant_and_an_oversized_frame(clusters, tokenizer, fault_report):
    cluster = clusters["disaggregated"]
    assert_workers_empty(cluster)
    decode = cluster.backend.decode[0]
    # A reservation as the router makes one: the grant goes to no one here.
    prompt = english_token_ids(tokenizer, 40)
    request = WorkerRequest(f"forged-{uuid.uuid4().hex}", prompt, SamplingParams(max_tokens=4))
    dest = cluster.run(awaited(decode.handle.reserve.remote(request)))
    # The forger knows everything public: the address, the model (its fingerprint), the layout.
    loaded = load_model(resolve_model_source(None), torch.float32)
    layers, heads, dim = loaded.config.num_layers, loaded.config.num_kv_heads, loaded.config.head_dim
    forger: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    monitor = forger.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        forger.connect(dest.address)
        forger.send(encode(MessageKind.HELLO, model=model_fingerprint(loaded),
                           layout=dict(num_layers=layers, num_blocks=4, block_size=16, num_kv_heads=heads,
                                       head_dim=dim, dtype="float32")))
        assert forger.poll(10_000) and msgpack.unpackb(forger.recv())["kind"] == MessageKind.HELLO_OK
        before = _dropped(cluster, decode, "no_grant")
        rows = bytes(len(prompt) * heads * dim * 4)
        for layer in range(layers):
            forger.send_multipart([encode(MessageKind.LAYER, request.request_id, layer=layer, token_start=0,
                                          num_tokens=len(prompt), block_ids=list(dest.block_ids[:3]),
                                          dtype="float32", row_shape=[heads, dim], frame_tokens=[len(prompt)]),
                                   rows, rows])
        forger.send(encode(MessageKind.ABORT, request.request_id))
        wait_until(lambda: _dropped(cluster, decode, "no_grant") - before == layers + 1, 30,
                   "the decode worker drops every forged message")
        held = cluster.run(awaited(decode.handle.inventory.remote()))
        assert held.num_reserved == 1  # the reservation stands: the forged ABORT ended nothing
        # A frame larger than the whole pool's layer: disconnected before it is buffered.
        load = decode.load
        cap = max(MAX_HEADER_BYTES, load.num_blocks * load.block_size * heads * dim * 4)
        forger.send_multipart([encode(MessageKind.HELLO, layout={}), bytes(cap + 1)])
        assert monitor.poll(10_000), "the decode worker kept the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        forger.disable_monitor()
        monitor.close(linger=0)
        forger.close()
    assert cluster.run(awaited(decode.handle.abort.remote(request.request_id)))
    assert_serves(cluster, tokenizer)
    assert_workers_empty(cluster, timeout=30)
    leaked = num_leaked_blocks(cluster)
    assert leaked == 0
    fault_report.add("KV sent by a peer without the grant", injected=layers + 1, affected=1, clear=1, leaked=leaked,
                     recovery_s=None, note=f"{layers} forged layers and a forged ABORT for a live reservation: all "
                                           "dropped (no_grant), the reservation stood, the worker served on")
    fault_report.add("oversized KV frame", injected=1, affected=0, clear=0, leaked=leaked, recovery_s=None,
                     note=f"a {cap + 1}-byte frame (the cap: one layer of the whole pool): the peer disconnected "
                          "by ZMQ before the frame was buffered; the worker served on")
