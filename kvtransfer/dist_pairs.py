"""torch.distributed groups of two, one per sender-receiver connection: how a prefill and a
decode worker share a process group without a world fixed at start-up.

Why pairs, not one group over every pool worker: a world is fixed when it is made, so a
worker that Ray restarts could never take its old rank back (and a worker's default group
belongs to its tensor-parallel ranks). A pair is made in the handshake instead: the receiver
hosts a TCPStore for the rendezvous (bound to its own address, never to every interface),
tells the sender its port and a fresh key, and both build the group, the sender as rank 0,
the receiver as rank 1. A pair dies with either side; a restarted worker shakes hands
again and gets a new one.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import socket
import threading
import uuid
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from tandem.kvtransfer.payload import DistPayload

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
SENDER_RANK, RECEIVER_RANK = 0, 1
MAX_WAIT_S = 10.0
"""The longest a pair's operation (its rendezvous, a send, a recv) may wait for the other
side. A live peer answers at once: the tensors follow their header straight away, and the
receiver reads them as soon as it reads the header. So this only bounds how long a hung
peer holds a sender's engine loop, and stays below the router's hang threshold (15 s), so
that a hung decode worker is not mistaken for a hung prefill worker too."""


def can_host(backend: str, device: torch.device) -> str | None:
    """-> why a pool on `device` cannot take KV by `backend`, or None when it can."""
    if backend not in BACKENDS:
        return f"unknown torch.distributed backend {backend!r}"
    if backend == "gloo" and not dist.is_gloo_available():
        return "this torch has no gloo"
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        return "NCCL needs the pool on a CUDA device"
    return None


def address_host(address: str) -> str:
    """The host of a ZMQ address: "tcp://10.0.0.5:5555" -> "10.0.0.5"; ipc and inproc are this host."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "localhost":
        return "127.0.0.1"
    return parts.hostname


def route_to(host: str) -> str:
    """This host's address on the route to `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _build(backend: str, store: dist.Store, key: str, rank: int, host: str,
           timeout: datetime.timedelta) -> DistPayload:
    """Both ranks call this; it returns once both have joined (or raises after `timeout`)."""
    prefixed = dist.PrefixStore(f"kv-pair/{key}/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        # Gloo's own sockets: on the address the peer reaches, not whatever the hostname resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
    else:  # untested here (no GPU): the same calls with NCCL's group
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return DistPayload.over(group, rank, backend)


class PairHost:
    """The receiver's side: one TCPStore, and the receiver's half of each sender's pair,
    built on a thread of its own (the receiver's I/O thread must not wait for a sender)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        """address: the receiver's ZMQ address; its host is where the store and gloo listen."""
        self.host = address_host(address)
        self.timeout = datetime.timedelta(seconds=min(timeout_s, MAX_WAIT_S))
        self._store: dist.TCPStore | None = None
        self._port = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pair")
        self._lock = threading.Lock()

    def _ensure_store(self) -> dist.TCPStore:
        with self._lock:
            if self._store is None:
                # Our own listening socket, so the store binds only where the receiver does
                # (TCPStore alone listens on every interface); the store owns it from here.
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                    listener.bind((self.host, 0))
                    listener.listen(128)
                    self._port = listener.getsockname()[1]
                    self._store = dist.TCPStore(self.host, self._port, is_master=True, wait_for_workers=False,
                                                timeout=self.timeout, master_listen_fd=os.dup(listener.fileno()))
            return self._store

    def offer(self, backend: str) -> tuple[dict[str, Any], concurrent.futures.Future]:
        """-> (the HELLO_OK fields that tell the sender where to meet, the receiver's half
        of the pair: a DistPayload once the sender has joined)."""
        store = self._ensure_store()
        key = uuid.uuid4().hex
        future = self._pool.submit(_build, backend, store, key, RECEIVER_RANK, self.host, self.timeout)
        return {"backend": backend, "store_port": self._port, "key": key}, future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._store = None  # NOTE: the store's server stops with its last reference


class ReceiverPairs:
    """A receiver's pairs, by the ZMQ identity of the sender each was made with (used by the
    receiver's I/O thread only); the rendezvous is hosted from the first one on."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self._address, self._timeout_s = address, timeout_s
        self._host: PairHost | None = None
        self._pairs: dict[bytes, concurrent.futures.Future] = {}

    def __contains__(self, sender: bytes) -> bool:
        return sender in self._pairs

    def offer(self, sender: bytes, backend: str) -> dict[str, Any]:
        """A new pair with `sender` (replacing any before) -> the HELLO_OK fields for it.
        Raises OSError or RuntimeError when no rendezvous can be hosted."""
        if self._host is None:
            self._host = PairHost(self._address, self._timeout_s)
        fields, self._pairs[sender] = self._host.offer(backend)
        return fields

    def payload(self, sender: bytes) -> DistPayload:
        """This side of `sender`'s pair, waiting for it to be built (the sender has built its
        own before it sends, so it is all but done). Raises when it could not be built."""
        return self._pairs[sender].result(timeout=self._timeout_s)

    def forget(self, sender: bytes) -> None:
        """Drop `sender`'s pair (it broke, or the sender shook hands again)."""
        self._pairs.pop(sender, None)

    def close(self) -> None:
        self._pairs.clear()
        if self._host is not None:
            self._host.close()


def join_pair(address: str, offer: dict[str, Any], timeout_s: float) -> DistPayload:
    """The sender's half: join the pair the receiver at `address` offered in its HELLO_OK.
    Raises RuntimeError (or ValueError on a bad offer) when the pair cannot be made."""
    backend, port, key = offer.get("backend"), offer.get("store_port"), offer.get("key")
    if backend not in BACKENDS or not isinstance(port, int) or not isinstance(key, str) or not key.isalnum():
        raise ValueError(f"a bad torch.distributed offer from {address}: {offer!r}")
    host = address_host(address)
    timeout = datetime.timedelta(seconds=min(timeout_s, MAX_WAIT_S))
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return _build(backend, store, key, SENDER_RANK, route_to(host), timeout)
