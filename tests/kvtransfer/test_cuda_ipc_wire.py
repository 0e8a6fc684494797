"""The CUDA IPC path's parts that need no GPU: its export's wire fields (msgpack, never
pickle) checked before use, the handle given only to a sender on the pool's GPU, a
malformed export refused with a clear ProtocolError (the transfer then goes by frames),
and the in-place interface over a grant table alone (shared_pool.FenceFile). The export
and open themselves run on a GPU: `tandem bench gpu` (tandem/bench/gpu/ipc.py)."""

from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
import pytest
import torch
from kv_pools import random_pool, token_rows
from sender_wait import wait

from tandem.kvtransfer.connectors.base import ReceiverSide, SenderSide
from tandem.kvtransfer.connectors.cuda_ipc_in_place import CudaIpcConnector
from tandem.kvtransfer.cuda_ipc import MAX_HANDLE_BYTES, DeviceTarget, IpcHandle, pool_view
from tandem.kvtransfer.handshake import answer_hello
from tandem.kvtransfer.in_place import InPlaceWrites, device_copier
from tandem.kvtransfer.payload import layout_for
from tandem.kvtransfer.peer import connect_peer
from tandem.kvtransfer.protocol import Destination, MessageKind, ProtocolError, TransferStatus, decode, encode
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.shared_pool import FenceFile, MappedFence, MappedPool, pool_bytes

SHAPE = (2, 2, 8, 4, 2, 8)
LAYOUT = layout_for(SHAPE, torch.float32)
GOOD = IpcHandle(b"\x01" * 64, pool_bytes(LAYOUT), 512, b"/torch_123_456_0", 3, b"\x02" * 64, True)


def test_the_export_round_trips_through_msgpack():
    _, _, reply = decode(encode(MessageKind.HELLO_OK, layout=LAYOUT.as_dict(), cuda_ipc=GOOD.as_wire()))
    assert IpcHandle.from_wire(reply["cuda_ipc"], LAYOUT) == GOOD
    no_event = IpcHandle(b"h" * 64, pool_bytes(LAYOUT), 0, b"/c", 0, None, False)
    assert IpcHandle.from_wire(decode(encode(MessageKind.HELLO_OK, cuda_ipc=no_event.as_wire()))[2]["cuda_ipc"],
                               LAYOUT) == no_event


@pytest.mark.parametrize("change, says", [
    ({"handle": b"\x01" * (MAX_HANDLE_BYTES + 1)}, "handle must be 1 to 1024 bytes"),
    ({"handle": "not bytes"}, "handle must be 1 to 1024 bytes"),
    ({"ref_counter": b""}, "ref_counter must be 1 to 256 bytes"),
    ({"size": pool_bytes(LAYOUT) * 2}, f"exports {pool_bytes(LAYOUT) * 2} bytes"),
    ({"offset": -1}, "offset must be an integer"),
    ({"ref_counter_offset": True}, "ref_counter_offset must be an integer"),
    ({"event": None}, "event_sync must be a boolean (with an event when true)"),
    ({"extra": 1}, "cuda_ipc needs exactly"),
])
def test_a_malformed_export_is_refused(change: dict[str, Any], says: str):
    with pytest.raises(ProtocolError, match=r"^malformed: .*" + says.replace("(", r"\(").replace(")", r"\)")):
        IpcHandle.from_wire({**GOOD.as_wire(), **change}, LAYOUT)
    with pytest.raises(ProtocolError, match="cuda_ipc needs exactly"):
        IpcHandle.from_wire([1, 2], LAYOUT)


class FakeDeviceExport:
    """A receiver's DevicePoolExport, its pool on the CPU (its export is all the handshake reads)."""

    path = "cuda_ipc"
    device = "GPU-1111"

    def __init__(self, kv_cache: torch.Tensor, fields: dict[str, Any]) -> None:
        self.kv_cache = kv_cache
        fence_file = FenceFile.create(LAYOUT)
        assert fence_file is not None
        self._file = fence_file
        self.name, self.num_bytes, self.fence = self._file.name, self._file.num_bytes, self._file.fence
        self.fields = fields
        self.num_exports = 0

    def export(self) -> dict[str, Any]:
        self.num_exports += 1
        return {"cuda_ipc": self.fields}

    def close(self) -> None:
        self._file.close()


def hello(pool: FakeDeviceExport, **fields: Any) -> dict[str, Any]:
    return {"layout": LAYOUT.as_dict(), "shm_pool": pool.name, "shm_bytes": pool.num_bytes, "in_place": "cuda_ipc",
            **fields}


class OfferedPairs:
    """A receiver's pairs that offer every pair asked for (no rendezvous is hosted)."""

    def offer(self, sender: bytes, backend: str) -> dict[str, Any]:
        return {"backend": backend}


def receiver_side(pool: FakeDeviceExport | None, device: str = "", unencrypted_pairs_refused: bool = False
                  ) -> ReceiverSide:
    return ReceiverSide(LAYOUT, device, torch.device("cpu"), pool, cast(Any, OfferedPairs()), unencrypted_pairs_refused)


def test_only_a_sender_on_the_pools_gpu_gets_the_handle():
    pool = FakeDeviceExport(torch.zeros(SHAPE), GOOD.as_wire())
    try:
        def reply(msg: dict[str, Any]) -> dict[str, Any]:
            why, fields, path = answer_hello(msg, receiver_side(pool, pool.device), None, b"s")
            assert why is None and path is not None
            return fields
        assert reply(hello(pool, device="GPU-1111"))["cuda_ipc"] == GOOD.as_wire()
        assert "cuda_ipc" in reply(hello(pool, device="GPU-2222", peer_access=True))
        for other in (hello(pool, device="GPU-2222"), hello(pool), hello(pool, device="GPU-1111", in_place="shm"),
                      hello(pool, device="GPU-1111", shm_bytes=pool.num_bytes + 8)):
            assert "cuda_ipc" not in reply(other) and "shm_pool" not in reply(other)
        assert pool.num_exports == 2  # exported for those two alone
        # Never a pair with a sender on its GPU; none at all with the secret, unless acknowledged.
        nccl = hello(pool, device="GPU-1111", dist_pair="nccl", dist_required=True)
        why, _, _ = answer_hello(nccl, receiver_side(pool, "GPU-1111"), None, b"s")
        assert why is not None and "one GPU" in why
        gloo = {"layout": LAYOUT.as_dict(), "dist_pair": "gloo", "dist_required": True}
        why, _, _ = answer_hello(gloo, receiver_side(None, unencrypted_pairs_refused=True), None, b"s")
        assert why is not None and "TANDEM_KV_SECRET is set" in why and "--kv-allow-unencrypted-pairs" in why
        assert answer_hello(gloo, receiver_side(None), None, b"s")[1]["dist_pair"] == {"backend": "gloo"}
    finally:
        pool.close()


@pytest.mark.parametrize("fields, logged", [
    ({**GOOD.as_wire(), "handle": b"x" * (MAX_HANDLE_BYTES + 1)}, "a malformed CUDA IPC export"),
    (GOOD.as_wire(), "this process does not see the receiver's GPU GPU-1111"),
])
def test_an_export_that_cannot_be_opened_leaves_frames(fields: dict, logged: str, caplog: pytest.LogCaptureFixture):
    dst = torch.zeros(SHAPE)
    pool = FakeDeviceExport(dst, fields)
    receiver = KVReceiver(dst, timeout_s=10, shared_pool=pool)
    try:
        dest = Destination("r", receiver.address, (0,), 1, node_id="node-a", shm_pool=pool.name, device="GPU-1111")
        connector = CudaIpcConnector("cuda_ipc", SenderSide(receiver.address, dest, "node-a", "GPU-1111", "auto", 5))
        with caplog.at_level(logging.WARNING, "tandem.kvtransfer"):
            peer = connect_peer(receiver.address, {"layout": LAYOUT.as_dict(), "device": "GPU-1111"}, 5, connector)
        assert peer.path == "zmq" and pool.num_exports == 1
        assert logged in caplog.text and "sockets instead" in caplog.text
        peer.close()
    finally:
        receiver.close()
        pool.close()


def test_a_device_target_writes_under_the_grant_fence():
    """The IPC target's interface over a grant table alone (its pool on the CPU here)."""
    dst = torch.zeros(SHAPE)
    fence_file = FenceFile.create(LAYOUT)
    assert fence_file is not None
    target = DeviceTarget(MappedFence(fence_file.name, MappedFence.open(fence_file.name), LAYOUT), dst)
    with pytest.raises(ValueError, match="holds"):  # a grant table is no pool (nor the other way)
        MappedPool(fence_file.name, MappedPool.open(fence_file.name), LAYOUT)
    src = random_pool(2, 4, 4, 2, 8, torch.float32, seed=1)
    try:
        assert target.path == "cuda_ipc" and target.owner_alive()
        blocks = [5, 2]
        token = fence_file.fence.grant(blocks)
        writes = InPlaceWrites(target, Destination("r", "", tuple(blocks), 7, shm_grant=token), 4)
        for layer in range(2):
            assert writes.write(layer, 0, 7, src[layer].flatten(1, 2), [1, 3])
        assert torch.equal(token_rows(dst, blocks, 7), token_rows(src, [1, 3], 7))
        fence_file.fence.revoke(blocks)  # NOTE: after this, nothing lands
        late = InPlaceWrites(target, Destination("r2", "", tuple(blocks), 7, shm_grant=token), 4)
        assert not late.write(0, 0, 7, torch.ones(2, 7, 2, 8), None)
        assert torch.equal(token_rows(dst, blocks, 7), token_rows(src, [1, 3], 7))
    finally:
        target.close()
        fence_file.close()


def test_the_device_copier_and_pool_view():
    dst, src = torch.zeros(2, 16, 3), torch.arange(2 * 10 * 3, dtype=torch.float32).view(2, 10, 3)
    for dst_slots, src_slots in ((np.array([4, 5, 6]), np.array([7, 8, 9])), (np.array([9, 1, 14]), None)):
        dst.zero_()
        device_copier(dst_slots, src_slots, dst.device, src.device)(dst, src)
        expected = torch.zeros(2, 16, 3)
        expected[:, dst_slots] = src[:, np.arange(3) if src_slots is None else src_slots]
        assert torch.equal(dst, expected)
    storage = torch.UntypedStorage(pool_bytes(LAYOUT))
    view = pool_view(storage, LAYOUT)
    assert view.shape == SHAPE and view.dtype == torch.float32 and view.data_ptr() == storage.data_ptr()


def test_a_transfer_to_a_device_export_by_frames_is_whole():
    """A sender that takes frames from a receiver exporting its pool: the KV arrives all the same."""
    dst = torch.zeros(SHAPE)
    pool = FakeDeviceExport(dst, GOOD.as_wire())
    receiver = KVReceiver(dst, timeout_s=10, shared_pool=pool)
    from tandem.kvtransfer.sender import KVSender
    src = random_pool(2, 4, 4, 2, 8, torch.float32, seed=2)
    sender = KVSender(src, timeout_s=10)
    try:
        dest = receiver.expect("r", [3, 6], 8)
        assert dest.device == "GPU-1111" and dest.shm_pool == pool.name
        assert sender.begin(dest, [0, 2]) == "zmq"  # a sender on the CPU: never offered the handle
        sender.send_layer("r", 0)
        sender.send_layer("r", 1)
        assert wait(sender, "r", 10).status is TransferStatus.DONE and pool.num_exports == 0
        assert torch.equal(token_rows(dst, [3, 6], 8), token_rows(src, [0, 2], 8))
    finally:
        sender.close()
        receiver.close()
        pool.close()
