"""CUDA IPC, in place: the receiver's pool on a GPU, opened by the sender from the export in
the HELLO_OK (cuda_ipc.py) and written device to device; the grant table is a host file.
Taken on one GPU (whatever transport was asked for: NCCL allows one rank per device), or
between two GPUs of a node with peer access (`auto`)."""

from __future__ import annotations

import os
from typing import Any

from tandem.kvtransfer.connectors.in_place_paths import InPlaceConnector
from tandem.kvtransfer.cuda_ipc import DeviceTarget
from tandem.kvtransfer.handshake import SharedPool
from tandem.kvtransfer.protocol import KVLayout
from tandem.kvtransfer.shared_pool import MappedFence


class CudaIpcConnector(InPlaceConnector):
    def offer(self) -> dict[str, Any]:
        dest = self.side.destination
        assert dest is not None  # (hello offers only for a destination with a pool)
        return {"in_place": "cuda_ipc", "peer_access": dest.device != self.side.device}

    def open_target(self, name: str, fd: int, layout: KVLayout, reply: dict[str, Any]) -> DeviceTarget:
        dest = self.side.destination
        assert dest is not None
        try:
            fence = MappedFence(name, fd, layout)
        except BaseException:
            os.close(fd)
            raise
        try:
            return DeviceTarget.open(fence, reply.get("cuda_ipc"), dest.device, self.side.node_id)
        except BaseException:
            fence.close()
            raise

    @classmethod
    def may_take(cls, hello: dict[str, Any], pool: SharedPool) -> bool:
        """A sender on the pool's GPU, or one that says it reaches it by peer access."""
        return bool(hello.get("device")) and (hello.get("device") == pool.device or hello.get("peer_access") is True)
