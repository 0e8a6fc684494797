"""Prefix blocks fetched from another worker's disk tier over real ZMQ sockets: back bit for
bit, only the leading blocks the peer holds, a block failing its checksum (in the peer's file
or on the wire) stops the fetch before it, another layout or a peer without the cluster's keys
gets nothing, and a peer that never answers costs the timeout, not an error."""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch
import zmq

from tandem.kvcache.disk_tier import HEADER, MAGIC, DiskTier, checksum, parse_record
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.protocol import MessageKind, decode, encode
from tandem.kvtransfer.tier_peer import MAX_BLOCKS_PER_FETCH, TierServer, fetch_blocks

SHAPE = (3, 2, 8, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def h(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def peer(tmp_path):
    """A disk tier holding blocks h(1)..h(4) (pool blocks 0-3, written to disk), served on loopback."""
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    tier = DiskTier(kv, str(tmp_path / "a"), 1 << 20, "layout")
    for i in range(4):
        tier.offload(i, h(i + 1))
    tier.flush()
    server = TierServer(tier, "127.0.0.1", None)
    yield tier, server
    server.close()
    tier.close()


def test_blocks_come_back_bit_for_bit_and_only_the_leading_ones_held(peer, tmp_path):
    tier, server = peer
    mine = DiskTier(torch.zeros(SHAPE), str(tmp_path / "b"), 1 << 20, "layout")
    # h(9) is not held: h(3) after it is not sent (a prefix is no use past its gap).
    result = fetch_blocks(server.address, "layout", [h(1), h(2), h(9), h(3)], tier.block_bytes, None)
    assert result.error is None and len(result.payloads) == 2
    for i, payload in enumerate(result.payloads):
        mine.offload_copy(h(i + 1), mine.block_of(payload))
        assert mine.load(h(i + 1), 5 + i)
        assert torch.equal(mine.kv_cache[:, :, 5 + i], tier.kv_cache[:, :, i])
    assert server.num_served_blocks == 2
    mine.close()


def test_a_corrupt_file_at_the_peer_ends_the_fetch_before_it(peer):
    tier, server = peer
    path = tier.path_of(h(3))
    data = bytearray(open(path, "rb").read())
    data[-7] ^= 0x01
    open(path, "wb").write(bytes(data))
    result = fetch_blocks(server.address, "layout", [h(1), h(2), h(3), h(4)], tier.block_bytes, None)
    assert result.error is None and len(result.payloads) == 2  # the peer dropped h(3): held up to it
    assert tier.counters.num_corrupt_blocks == 1 and not tier.holds(h(3))


def test_a_flipped_byte_on_the_wire_is_refused():
    payload = torch.arange(16, dtype=torch.float32).numpy().tobytes()
    record = bytearray(HEADER.pack(MAGIC, h(1), len(payload), checksum(payload)) + payload)
    assert parse_record(bytes(record), h(1), len(payload)) == payload
    assert parse_record(bytes(record), h(2), len(payload)) is None  # another block's record
    assert parse_record(bytes(record[:-1]), h(1), len(payload)) is None  # truncated
    record[HEADER.size + 3] ^= 0x40
    assert parse_record(bytes(record), h(1), len(payload)) is None


def fetch_from_a_fake(answer, block_hashes: list[bytes], block_bytes: int):
    """fetch_blocks against a server that replies, once, the frames ``answer(request)`` makes."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        identity, request = socket.recv_multipart()
        socket.send_multipart([identity, *answer(request)])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        return fetch_blocks(f"tcp://127.0.0.1:{port}", "layout", block_hashes, block_bytes, None)
    finally:
        thread.join()
        socket.close()


def test_a_tampered_reply_keeps_only_the_blocks_before_the_bad_one(peer):
    """A server whose second record has a flipped byte (a link that corrupts it in flight)."""
    tier, server = peer

    def tampered(request: bytes) -> list[bytes]:
        frames = server.answer(request)
        bad = bytearray(frames[2])
        bad[HEADER.size + 11] ^= 0x08
        return [frames[0], frames[1], bytes(bad), *frames[3:]]

    result = fetch_from_a_fake(tampered, [h(1), h(2), h(3)], tier.block_bytes)
    assert len(result.payloads) == 1 and "failed its check" in (result.error or "")


def test_a_reply_that_is_not_blocks_brings_nothing(peer):
    tier, server = peer
    for header in (encode(MessageKind.DONE, "r", num_blocks=1, error=None),
                   encode(MessageKind.BLOCKS, "r", num_blocks="1", error=None), b"\xc1"):
        result = fetch_from_a_fake(lambda request: [header, *server.answer(request)[1:]], [h(1)], tier.block_bytes)
        assert result.payloads == [] and "a malformed reply" in (result.error or "")


def test_another_layout_or_a_malformed_request_is_refused(peer):
    tier, server = peer
    result = fetch_blocks(server.address, "other", [h(1)], tier.block_bytes, None)
    assert result.payloads == [] and "another KV layout" in (result.error or "")

    def refusal(request: bytes) -> str:
        kind, _, reply = decode(server.answer(request)[0])
        assert kind is MessageKind.BLOCKS and reply["num_blocks"] == 0
        return reply["error"]

    assert "not msgpack" in refusal(b"\xc1 not msgpack")
    assert "version" in refusal(msgpack.packb({"v": 99, "kind": 8, "request_id": "r"}))
    assert "not LAYER" in refusal(encode(MessageKind.LAYER, "r"))
    assert "block hashes" in refusal(encode(MessageKind.FETCH, "r", layout="layout", block_hashes=["01" * 16]))
    assert "block hashes" in refusal(encode(MessageKind.FETCH, "r", layout="layout",
                                            block_hashes=[h(1)] * (MAX_BLOCKS_PER_FETCH + 1)))
    assert server.num_refused == 6
    _, request_id, reply = decode(server.answer(encode(MessageKind.FETCH, "req-7", layout="layout",
                                                       block_hashes=[h(1)]))[0])
    assert (request_id, reply["num_blocks"], reply["error"]) == ("req-7", 1, None)


def test_a_silent_peer_costs_the_timeout_and_a_keyless_one_gets_nothing(peer, tmp_path):
    tier, _ = peer
    silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    result = fetch_blocks(f"tcp://127.0.0.1:{port}", "layout", [h(1)], tier.block_bytes, None, timeout_s=0.3)
    assert result.payloads == [] and "no reply" in (result.error or "")
    silent.close()
    assert fetch_blocks("tcp://nowhere", "layout", [h(1)], tier.block_bytes, None).payloads == []

    keys = CurveKeys.from_secret("a cluster secret of some length")
    secured = TierServer(tier, "127.0.0.1", keys)
    try:
        ok = fetch_blocks(secured.address, "layout", [h(1), h(2)], tier.block_bytes, keys)
        assert ok.error is None and len(ok.payloads) == 2
        keyless = fetch_blocks(secured.address, "layout", [h(1)], tier.block_bytes, None, timeout_s=0.5)
        assert keyless.payloads == [] and secured.num_served_blocks == 2
    finally:
        secured.close()
