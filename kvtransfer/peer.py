"""A sender's connection to one receiver: its DEALER socket, the handshake, and the data path
the two settle on (frames, torch.distributed, or in place in a shared pool)."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from tandem.kvtransfer.cuda_ipc import DeviceTarget, IpcOffer
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.dist_pairs import RECEIVER_RANK, join_pair
from tandem.kvtransfer.in_place import InPlaceTarget
from tandem.kvtransfer.payload import DistPayload
from tandem.kvtransfer.protocol import KVLayout, MessageKind, ProtocolError, TransferRefused, decode, encode
from tandem.kvtransfer.shared_pool import MappedFence, MappedPool

logger = logging.getLogger(__name__)

SEND_QUEUE_MESSAGES = 100_000


@dataclass
class Peer:
    """A sender's connection to one receiver, owned by the sender's thread."""

    socket: zmq.Socket
    layout: KVLayout
    """The receiver's pool layout, from the handshake."""
    dist_rank: int | None
    """The receiver's rank in `dist`'s group, when the rows go by torch.distributed."""
    target: InPlaceTarget | None = None
    """The receiver's pool opened here, when the rows are written into it in place: mapped
    from host shared memory, or opened by CUDA IPC on its GPU."""
    dist: DistPayload | None = None
    """The group the rows go by: a pair made in the handshake, or the sender's world."""
    lost: str = ""
    """Why the data path broke (a torch.distributed peer gone): nothing more goes by it."""

    @property
    def path(self) -> str:
        """The data path: "shm" or "cuda_ipc" (in place), "dist" (torch.distributed) or "zmq" (frames)."""
        return self.target.path if self.target is not None else "zmq" if self.dist_rank is None else "dist"

    def unmap_if_orphaned(self, address: str) -> bool:
        """Let go of the receiver's pool once its owner is gone: mapped here, a dead
        worker's pool would stay in memory. -> whether it did (then no transfer may write
        into it any more: its fence's descriptor is closed)."""
        if self.target is None or self.target.owner_alive():
            return False
        logger.warning("kv sender: the pool of %s has no owner any more: unmapped", address)
        self.target.close()
        self.target = None  # its tensors go with it, and with them the mapping
        return True

    def close(self) -> None:
        self.socket.close()
        if self.target is not None:
            self.target.close()
        if self.dist is not None:
            self.dist.close()  # the pair's group (a world's payload, shared, is left as it is)


def connect_peer(address: str, hello: dict[str, Any], timeout_s: float, shm_pool: str = "",
                 dist_pair: str = "", dist_required: bool = False, curve: CurveKeys | None = None,
                 ipc: IpcOffer | None = None) -> Peer:
    """Handshake with the receiver at `address` with `hello` (the sender's fields).

    shm_pool: the receiver's pool file, offered when this process can open it: the rows go
    in place if the receiver agrees and the file is a pool of its layout, else by socket.
    ipc: the receiver's pool is on a GPU, to be written by CUDA IPC (shm_pool then names its
    grant table): opened here from the export in the HELLO_OK, else (logged) by socket.
    dist_pair: a torch.distributed backend ("gloo", "nccl") to send the rows by, in a group
    of two made now (dist_pairs.py); dist_required: the receiver must take it, or refuse.
    curve: the cluster's CurveZMQ keys, which the receiver must serve with.
    Raises TransferRefused when the receiver refuses (or the pair cannot be made),
    TimeoutError when it does not answer.
    """
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    # Queue nothing for a receiver that is gone (sends fail at once instead), and allow
    # many layers in flight: queued frames are views of the pool, not copies.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if curve is not None:
        curve.connect(sock)
    sock.connect(address)
    if dist_pair:
        hello = {**hello, "dist_pair": dist_pair, "dist_required": dist_required}
    shm_fd = None
    if shm_pool:
        try:
            shm_fd = MappedPool.open(shm_pool)
            hello = {**hello, "shm_pool": shm_pool, "shm_bytes": os.fstat(shm_fd).st_size}
            if ipc is not None:
                hello.update(in_place="cuda_ipc", peer_access=ipc.peer_access)
        except (OSError, ValueError) as e:
            logger.warning("kv sender: cannot open %s's pool %s (%s): sockets instead", address, shm_pool, e)
    try:
        msg = _handshake(sock, address, hello, timeout_s)
        layout = KVLayout.from_dict(msg.get("layout"))
    except BaseException:
        sock.close()
        if shm_fd is not None:
            os.close(shm_fd)
        raise
    shm = None if shm_fd is None else _open_target(address, shm_pool, shm_fd, layout, msg, ipc)
    if "dist_pair" not in msg:
        return Peer(sock, layout, msg.get("dist_rank"), shm)
    try:
        pair = join_pair(address, msg["dist_pair"], timeout_s)
    except (RuntimeError, ValueError, OSError) as e:
        sock.close()
        raise TransferRefused(f"no torch.distributed pair with the KV receiver at {address}: {e}") from None
    return Peer(sock, layout, RECEIVER_RANK, shm, dist=pair)


def _handshake(sock: zmq.Socket, address: str, hello: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """-> the receiver's HELLO_OK."""
    try:
        sock.send(encode(MessageKind.HELLO, **hello))
    except zmq.Again:
        raise TimeoutError(f"no KV receiver accepted a connection at {address} within {timeout_s} s") from None
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no KV receiver answered at {address} within {timeout_s} s")
    kind, _, msg = decode(sock.recv())
    if kind is not MessageKind.HELLO_OK:
        raise TransferRefused(f"KV receiver at {address} refused the transfer: {msg.get('reason')}")
    return msg


def _open_target(address: str, name: str, fd: int, layout: KVLayout, reply: dict[str, Any],
                 ipc: IpcOffer | None) -> InPlaceTarget | None:
    """The receiver's pool opened over `fd` (taken): mapped from the file, or by CUDA IPC
    with the file as its grant table; None (logged) when the receiver declined the offer,
    or the file is not one for its layout, or the export cannot be opened."""
    fence: MappedFence | None = None
    try:
        if reply.get("shm_pool") != name:
            raise ValueError("the receiver declined it")
        if ipc is None:
            return MappedPool(name, fd, layout)
        fence = MappedFence(name, fd, layout)
        return DeviceTarget.open(fence, reply.get("cuda_ipc"), ipc.receiver_device, ipc.node_id)
    except (OSError, ValueError, RuntimeError) as e:  # (a ProtocolError is a ValueError)
        if fence is not None:
            fence.close()
        else:
            os.close(fd)
        how = "a malformed CUDA IPC export" if isinstance(e, ProtocolError) else "no in-place path"
        logger.warning("kv sender: %s with %s (%s): sockets instead", how, address, e)
        return None
