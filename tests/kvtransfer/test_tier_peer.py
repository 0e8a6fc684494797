"""Prefix blocks fetched from another worker's tiers over the KV transfer layer, on real
sockets: back bit for bit, by ZMQ frames or a gloo pair, in chunks of the staging's size, only
the leading blocks the peer holds; a block failing its checksum in the peer's file ends the
fetch before it; another layout, a malformed message or a peer without the cluster's keys gets
nothing; a silent peer costs the timeout; and on every path both sides' staging blocks go back
and nothing stays reserved or offered."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from tandem.kvcache.disk_tier import HEADER, DiskTier
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.fetch_messages import destination_fields
from tandem.kvtransfer.protocol import Destination, MessageKind, decode, encode
from tandem.kvtransfer.tier_fetch import TierFetcher
from tandem.kvtransfer.tier_peer import MAX_BLOCKS_PER_FETCH, SenderSettings, TierServer

SHAPE = (3, 2, 8, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
TIMEOUT_S = 1.0


def h(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def tier(tmp_path):
    """A disk tier holding blocks h(1)..h(4) (pool blocks 0-3, written to disk)."""
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    tier = DiskTier(kv, str(tmp_path / "a"), 1 << 20, "layout")
    for i in range(4):
        tier.offload(i, h(i + 1))
    tier.flush()
    yield tier
    tier.close()


def serve(tier: DiskTier, curve: CurveKeys | None = None, transport: str = "auto") -> TierServer:
    return TierServer(tier, "127.0.0.1", curve, settings=SenderSettings(transport), timeout_s=TIMEOUT_S)


@pytest.fixture
def fetcher():
    """Staging for 3 blocks: a fetch of more comes in chunks."""
    fetcher = TierFetcher(torch.zeros(SHAPE)[:, :, 0], "127.0.0.1", None, timeout_s=TIMEOUT_S, num_staged_blocks=3)
    yield fetcher
    fetcher.close()


def assert_nothing_held(server: TierServer, fetcher: TierFetcher) -> None:
    assert server.staging.num_free == server.staging.num_blocks and server.num_offered == 0
    assert fetcher.staging.num_free == fetcher.staging.num_blocks
    assert fetcher._receiver is None or fetcher._receiver.num_pending == 0


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_blocks_come_back_bit_for_bit_and_only_the_leading_ones_held(tier, fetcher, transport):
    server = serve(tier, transport=transport)
    try:
        result = fetcher.fetch(server.address, "layout", [h(1), h(2), h(9), h(3)])
        assert result.error is None and len(result.blocks) == 2  # h(9) is a gap: h(3) is no use past it
        whole = fetcher.fetch(server.address, "layout", [h(1), h(2), h(3), h(4)])  # two chunks: 3, then 1
        assert whole.error is None and len(whole.blocks) == 4
        for i, block in enumerate(whole.blocks):
            assert torch.equal(block, tier.kv_cache[:, :, i]) and block.device.type == "cpu"
        assert server.num_served_blocks == 6
        # The transfer layer's own data paths: frames over the socket, or a torch.distributed pair.
        assert server._sender is not None
        assert [p.path for p in server._sender._peers.values()] == ["dist" if transport == "gloo" else "zmq"]
        assert_nothing_held(server, fetcher)
    finally:
        server.close()


def test_a_corrupt_file_at_the_peer_ends_the_fetch_before_it(tier, fetcher):
    path = tier.path_of(h(3))
    data = bytearray(open(path, "rb").read())
    data[HEADER.size + 5] ^= 0x01
    open(path, "wb").write(bytes(data))
    server = serve(tier)
    try:
        result = fetcher.fetch(server.address, "layout", [h(1), h(2), h(3), h(4)])
        assert result.error is None and len(result.blocks) == 2  # the peer dropped h(3): held up to it
        assert tier.counters.num_corrupt_blocks == 1 and not tier.holds(h(3))
        assert_nothing_held(server, fetcher)
    finally:
        server.close()


def test_another_layout_or_a_malformed_message_is_refused(tier, fetcher):
    server = serve(tier)
    try:
        result = fetcher.fetch(server.address, "other", [h(1)])
        assert result.blocks == [] and "another KV layout" in (result.error or "")

        def refusal(request: bytes) -> str:
            kind, _, reply = decode(server.answer(request))
            assert kind is MessageKind.OFFER and reply["num_blocks"] == 0
            return reply["error"]

        assert "not msgpack" in refusal(b"\xc1 not msgpack")
        assert "version" in refusal(msgpack.packb({"v": 99, "kind": 8, "request_id": "r"}))
        assert "not LAYER" in refusal(encode(MessageKind.LAYER, "r"))
        assert "block hashes" in refusal(encode(MessageKind.FETCH, "r", layout="layout", block_hashes=["01" * 16]))
        assert "block hashes" in refusal(encode(MessageKind.FETCH, "r", layout="layout",
                                                block_hashes=[h(1)] * (MAX_BLOCKS_PER_FETCH + 1)))
        assert "destination" in refusal(encode(MessageKind.PULL, "r", destination={"address": "tcp://x"}))
        assert server.num_refused == 7
        assert_nothing_held(server, fetcher)
    finally:
        server.close()


def test_an_offer_pulled_elsewhere_or_never_goes_back(tier):
    server = serve(tier)
    try:
        kind, _, offer = decode(server.answer(encode(MessageKind.FETCH, "f1", layout="layout",
                                                     block_hashes=[h(1), h(2)])))
        assert (kind, offer["num_blocks"], server.num_offered) == (MessageKind.OFFER, 2, 1)
        # Pulled to a receiver nobody listens at: the handshake's timeout, then the blocks go back.
        nowhere = Destination("f1", "tcp://127.0.0.1:9", (0, 1), 8, grant="00")
        kind, _, pulled = decode(server.answer(encode(MessageKind.PULL, "f1", **destination_fields(nowhere))))
        assert kind is MessageKind.PULLED and pulled["ok"] is False
        assert server.staging.num_free == server.staging.num_blocks and server.num_offered == 0
        # Offered and never pulled (a fetcher gone): back once the timeout has passed. Until
        # then a fetch finding every staging block offered is told so, not offered nothing.
        held = [h(1), h(2), h(3), h(4)]
        server.answer(encode(MessageKind.FETCH, "f2", layout="layout", block_hashes=held))
        rest = held * (server.staging.num_blocks // 4 - 1)  # (whatever it asks, as long as it is held)
        server.answer(encode(MessageKind.FETCH, "f3", layout="layout", block_hashes=rest))
        assert server.num_offered == 2 and server.staging.num_free == 0
        _, _, busy = decode(server.answer(encode(MessageKind.FETCH, "f4", layout="layout", block_hashes=[h(1)])))
        assert busy["num_blocks"] == 0 and busy["error"].startswith("busy")
        server._expire(float("inf"))
        assert server.staging.num_free == server.staging.num_blocks and server.num_offered == 0
    finally:
        server.close()


def test_a_silent_peer_costs_the_timeout_and_a_keyless_one_gets_nothing(tier, fetcher):
    silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    result = fetcher.fetch(f"tcp://127.0.0.1:{port}", "layout", [h(1)])
    assert result.blocks == [] and "no reply" in (result.error or "")
    silent.close()
    assert fetcher.fetch("tcp://nowhere", "layout", [h(1)]).blocks == []

    keys = CurveKeys.from_secret("a cluster secret of some length")
    secured = serve(tier, keys)
    keyed = TierFetcher(torch.zeros(SHAPE)[:, :, 0], "127.0.0.1", keys, timeout_s=TIMEOUT_S)
    try:
        ok = keyed.fetch(secured.address, "layout", [h(1), h(2)])
        assert ok.error is None and len(ok.blocks) == 2
        keyless = fetcher.fetch(secured.address, "layout", [h(1)])
        assert keyless.blocks == [] and secured.num_served_blocks == 2
        assert_nothing_held(secured, keyed)
    finally:
        keyed.close()
        secured.close()


def test_a_layer_failing_its_crc_on_arrival_brings_nothing(tier, fetcher, monkeypatch):
    """The sender's CRC-32 of one layer disagrees with its frames on arrival (as a byte flipped
    in flight): the receiver fails the transfer, and the fetch keeps none of its blocks."""
    from tandem.kvtransfer.connectors import zmq_frames

    crc, calls = zmq_frames.payload_crc32, []

    def flipped_once(frames):
        calls.append(1)
        return crc(frames) ^ (1 if len(calls) == 2 else 0)  # (the second one computed, sent or checked)

    monkeypatch.setattr(zmq_frames, "payload_crc32", flipped_once)
    server = serve(tier)
    try:
        result = fetcher.fetch(server.address, "layout", [h(1), h(2)])
        assert result.blocks == [] and "not" in (result.error or ""), result
        assert server.num_served_blocks == 0
        assert_nothing_held(server, fetcher)
        assert fetcher._receiver is not None and fetcher._receiver.dropped["checksum"] == 1
    finally:
        server.close()
