"""The connector interface: the built-in paths are registered by name, and a new transport is
one class and one registration, nothing else: `--kv-transport` offers it, the handshake asks
for it, both sides move its rows (checked byte for byte), the metrics label it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from kv_pools import random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer.connectors import registry
from tandem.kvtransfer.connectors.base import (
    Answer,
    KVConnector,
    LayerJob,
    ReceivePath,
    ReceiverSide,
    SenderLink,
    SendPath,
    check_rows,
)
from tandem.kvtransfer.payload import layer_rows
from tandem.kvtransfer.protocol import KVLayout, LayerHeader, MessageKind, ProtocolError, TransferStatus, encode
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.slots import token_slots


def test_the_built_in_paths_are_registered_in_the_receivers_order() -> None:
    assert list(registry.CONNECTORS) == ["nccl", "gloo", "cuda_ipc", "shm", "zmq"]
    assert registry.kv_transports() == ("auto", "nccl", "gloo", "zmq")  # shm and cuda_ipc: auto takes them
    assert registry.path_labels() == ("dist", "cuda_ipc", "shm", "zmq")
    assert all(issubclass(registry.load_connector(name), KVConnector) for name in registry.CONNECTORS)
    with pytest.raises(ValueError, match="registered already"):
        registry.register_connector("zmq", __name__, "InlineConnector", selectable=True)


# -- a new transport, in this file alone: the rows travel inside the LAYER header ----------
class InlineSend(SendPath):
    label = "inline"

    def send_layer(self, link: SenderLink, job: LayerJob) -> bool:
        slots = torch.from_numpy(token_slots(job.out.src_block_ids, link.layout.block_size, job.start, job.end))
        k, v = (layer_rows(link.kv_cache, job.layer, kv).index_select(0, slots) for kv in (0, 1))
        job.header.update(frame_tokens=[], inline=[k.numpy().tobytes(), v.numpy().tobytes()])
        if not link.send_message(job.request_id, [encode(MessageKind.LAYER, job.request_id, **job.header)]):
            return False
        link.count_sent(job.num_bytes)
        return True


class InlineReceive(ReceivePath):
    label = "inline"

    def rows(self, h: LayerHeader, frames: list[zmq.Frame], msg: dict[str, Any], layout: KVLayout
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        check_rows(h, layout)
        inline = msg.get("inline")
        if frames or not isinstance(inline, list) or len(inline) != 2:
            raise ProtocolError("malformed", f"{h.request_id}: an inline LAYER carries its rows in the header")
        k, v = (torch.frombuffer(bytearray(b), dtype=torch.float32).view(h.num_tokens, *h.row_shape) for b in inline)
        return [k], [v]


class InlineConnector(KVConnector):
    def hello(self) -> dict[str, Any]:
        return {"inline_rows": True}

    def open(self, layout: KVLayout, reply: dict[str, Any]) -> SendPath | None:
        return InlineSend() if reply.get("inline_rows") else None

    @classmethod
    def answer(cls, name: str, hello: dict[str, Any], side: ReceiverSide, sender: bytes) -> Answer | None:
        return Answer({"inline_rows": True}, InlineReceive()) if hello.get("inline_rows") else None


@pytest.fixture
def inline_registered() -> Iterator[None]:
    registry.register_connector("inline", __name__, "InlineConnector", selectable=True)
    try:
        yield
    finally:
        del registry.CONNECTORS["inline"]


@pytest.mark.usefixtures("inline_registered")
def test_a_new_transport_is_one_class_and_its_registration() -> None:
    from tandem.router import serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    assert parser.parse_args(["--kv-transport", "inline"]).kv_transport == "inline"
    assert "inline" in registry.path_labels()
    src, dst = random_pool(2, 8, 4, 2, 8, torch.float32, seed=1), random_pool(2, 6, 4, 2, 8, torch.float32, seed=2)
    before = dst.clone()
    receiver, sender = KVReceiver(dst, timeout_s=10), KVSender(src, timeout_s=10, transport="inline")
    try:
        dest = receiver.expect("r", [5, 0, 3], 10)
        assert sender.begin(dest, [7, 2, 4]) == "inline"
        assert all(sender.send_layer("r", layer) for layer in range(2))
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        event = receiver.get_event(10)
        assert event is not None and event.status is TransferStatus.DONE
        assert torch.equal(token_rows(dst, [5, 0, 3], 10), token_rows(src, [7, 2, 4], 10))
        untouched = [1, 2, 4]
        assert torch.equal(dst[:, :, untouched], before[:, :, untouched]) and not receiver.dropped
    finally:
        sender.close()
        receiver.close()


@pytest.mark.usefixtures("inline_registered")
def test_a_receiver_that_declines_a_transport_gets_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that does not take the path asked for answers by frames, and the sender sends by them."""
    monkeypatch.setattr(InlineConnector, "answer", classmethod(lambda cls, name, hello, side, sender: None))
    src, dst = random_pool(2, 8, 4, 2, 8, torch.float32, seed=3), random_pool(2, 6, 4, 2, 8, torch.float32, seed=4)
    receiver, sender = KVReceiver(dst, timeout_s=10), KVSender(src, timeout_s=10, transport="inline")
    try:
        assert sender.begin(receiver.expect("r", [1, 2], 5), [0, 1]) == "zmq"
        assert all(sender.send_layer("r", layer) for layer in range(2))
        assert wait(sender, "r", 10).status is TransferStatus.DONE
        assert torch.equal(token_rows(dst, [1, 2], 5), token_rows(src, [0, 1], 5))
    finally:
        sender.close()
        receiver.close()
