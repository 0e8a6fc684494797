"""What the two in-place paths share: the sender writes a layer's rows into the receiver's
own pool, under the receiver's grant fence (fence.py), and sends the header alone.

The receiver's pool is a file in the node's shared memory: the pool itself (host memory,
shm_in_place.py) or its grant table beside a CUDA IPC export (cuda_ipc_in_place.py). The
sender offers to open that file (`shm_pool`, its size); the receiver agrees only when the
offer names this very file, for this pool's path.
"""

from __future__ import annotations

import logging
import os
from abc import abstractmethod
from typing import Any

import torch
import zmq

from tandem.kvtransfer.connectors.base import (
    Answer,
    KVConnector,
    LayerJob,
    ReceivePath,
    ReceiverSide,
    SenderLink,
    SendPath,
    check_rows,
    not_negotiated,
)
from tandem.kvtransfer.handshake import SharedPool
from tandem.kvtransfer.in_place import InPlaceTarget, InPlaceWrites
from tandem.kvtransfer.outgoing import Outgoing
from tandem.kvtransfer.protocol import KVLayout, LayerHeader, MessageKind, ProtocolError, encode
from tandem.kvtransfer.shared_pool import MappedPool

logger = logging.getLogger(__name__)


class InPlaceSend(SendPath):
    def __init__(self, target: InPlaceTarget) -> None:
        self.target = target
        self.label = target.path  # (shm or cuda_ipc)
        self._closed = False

    def begin(self, out: Outgoing, block_size: int) -> None:
        """Plan the request's writes (ValueError for a destination whose blocks are not the pool's)."""
        out.in_place = InPlaceWrites(self.target, out.destination, block_size)

    def send_layer(self, link: SenderLink, job: LayerJob) -> bool:
        out = job.out
        if out.in_place is None:
            self.begin(out, link.layout.block_size)
        assert out.in_place is not None
        # K and V together: one copy op for both where the slots run side by side.
        src, src_blocks = ((torch.stack(job.rows), None) if job.rows is not None
                           else (link.kv_cache[job.layer].flatten(1, 2), out.src_block_ids))
        if not out.in_place.write(job.layer, job.start, job.end, src, src_blocks):
            link.fail(job.request_id, "the receiver revoked its grant")
            return False
        job.header.update(frame_tokens=[], in_place=True)
        sent = link.send_message(job.request_id, [encode(MessageKind.LAYER, job.request_id, **job.header)])
        if sent:
            link.count_sent(job.num_bytes)
        return sent

    def orphaned(self) -> bool:
        return not self._closed and not self.target.owner_alive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.target.close()


class InPlaceReceive(ReceivePath):
    """The rows are in the pool already: the header is checked all the same."""

    label = "in_place"

    def rows(self, h: LayerHeader, frames: list[zmq.Frame], msg: dict[str, Any], layout: KVLayout
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not h.in_place or frames:
            raise not_negotiated(h, "in-place")
        check_rows(h, layout)
        return [], []


IN_PLACE = InPlaceReceive()


class InPlaceConnector(KVConnector):
    """The sender's offer to open the receiver's pool file, and the receiver's answer."""

    _fd: int | None = None

    def hello(self) -> dict[str, Any]:
        dest = self.side.destination
        if dest is None or not dest.shm_pool:
            return {}
        try:
            self._fd = MappedPool.open(dest.shm_pool)
        except (OSError, ValueError) as e:
            logger.warning("kv sender: cannot open %s's pool %s (%s): sockets instead", self.side.address,
                           dest.shm_pool, e)
            return {}
        return {"shm_pool": dest.shm_pool, "shm_bytes": os.fstat(self._fd).st_size, **self.offer()}

    def offer(self) -> dict[str, Any]:
        """The path's own HELLO fields."""
        return {}

    def open(self, layout: KVLayout, reply: dict[str, Any]) -> SendPath | None:
        fd, self._fd = self._fd, None
        dest = self.side.destination
        if fd is None or dest is None:
            return None
        try:
            if reply.get("shm_pool") != dest.shm_pool:
                os.close(fd)
                raise ValueError("the receiver declined it")
            return InPlaceSend(self.open_target(dest.shm_pool, fd, layout, reply))
        except (OSError, ValueError, RuntimeError) as e:  # (a ProtocolError is a ValueError)
            how = "a malformed CUDA IPC export" if isinstance(e, ProtocolError) else "no in-place path"
            logger.warning("kv sender: %s with %s (%s): sockets instead", how, self.side.address, e)
            return None

    @abstractmethod
    def open_target(self, name: str, fd: int, layout: KVLayout, reply: dict[str, Any]) -> InPlaceTarget:
        """The receiver's pool opened over `fd` (taken: closed when this raises)."""

    def abandon(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def answer(cls, name: str, hello: dict[str, Any], side: ReceiverSide, sender: bytes) -> Answer | None:
        """NOTE: no sender but the one that asked, by this very file, is sent the pool's export."""
        pool = side.shared_pool
        if pool is None or pool.path != name or hello.get("in_place", "shm") != name \
                or hello.get("shm_pool") != pool.name or hello.get("shm_bytes") != pool.num_bytes \
                or not cls.may_take(hello, pool):
            return None
        try:
            exported = pool.export()
        except RuntimeError as e:  # CUDA would not export it: the sender sends frames instead
            logger.warning("kv receiver cannot export its pool by %s: %s", pool.path, e)
            return None
        return Answer({"shm_pool": pool.name, **exported}, IN_PLACE)

    @classmethod
    def may_take(cls, hello: dict[str, Any], pool: SharedPool) -> bool:
        """Whether this sender may write the pool (beyond naming its file)."""
        return True
