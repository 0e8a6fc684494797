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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from tandem.kvtransfer import pair_grant
from tandem.kvtransfer.payload import DistPayload

logger = logging.getLogger(__name__)

SENDER_RANK, RECEIVER_RANK = 0, 1
CLOSED_KEY = "closed"
"""Written under a pair's prefix when its sender closes it."""
MAX_WAIT_S = 10.0
"""The longest a pair's operation (its rendezvous, a send, a recv) may wait for the other
side. A live peer answers at once: the tensors follow their header straight away, and the
receiver reads them as soon as it reads the header. So this only bounds how long a hung
peer holds a sender's engine loop, and stays below the router's hang threshold (15 s), so
that a hung decode worker is not mistaken for a hung prefill worker too."""


@dataclass(frozen=True)
class PairBackend:
    """How pairs of one torch.distributed backend are made (see PAIR_BACKENDS)."""

    build: Callable[[dist.Store, int, datetime.timedelta, str], Any]
    """(the pair's store, this side's rank, the group's timeout, the address its own sockets
    listen on) -> this side's group of two, joined (it returns once both ranks have)."""
    device: Callable[[], torch.device]
    """Where this side's tensors live (called on the thread that builds the pair)."""
    refuses: Callable[[torch.device], str | None]
    """Why a pool on a device cannot take KV by this backend, or None."""
    empty: Callable[..., torch.Tensor] = torch.empty
    """How a tensor is allocated on `device` (torch.empty's signature)."""
    polled: bool = True
    """Whether a work's completion is polled against the payload's deadline (NCCL's wait
    neither blocks nor raises); else its wait() blocks and raises (gloo's, whose works
    complete only inside wait)."""


def _gloo(store: dist.Store, rank: int, timeout: datetime.timedelta, host: str) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs call it Options
    # Gloo's own sockets: on the address the peer reaches, not whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _nccl(store: dist.Store, rank: int, timeout: datetime.timedelta, host: str) -> Any:
    # NOTE: untested here (no GPU): the fake backend in tests/device plays it by NCCL's rules.
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, 2, options)
    # The communicator now, not at the first send: a refusal (two ranks on one device) then
    # fails the handshake instead of the first transfer.
    group.eager_connect_single_device(_cuda_device())
    return group


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _gloo_refuses(device: torch.device) -> str | None:
    return None if dist.is_gloo_available() else "this torch has no gloo"


def _nccl_refuses(device: torch.device) -> str | None:
    return None if device.type == "cuda" and dist.is_nccl_available() else "NCCL needs the pool on a CUDA device"


PAIR_BACKENDS: dict[str, PairBackend] = {
    "gloo": PairBackend(_gloo, lambda: torch.device("cpu"), _gloo_refuses, polled=False),
    "nccl": PairBackend(_nccl, _cuda_device, _nccl_refuses),
}
"""The backends a pair can be made with, by the name the handshake uses. NOTE: the one place
a backend's group is built; a test puts a stand-in here under a real name (tests/device)."""


def can_host(backend: str, device: torch.device) -> str | None:
    """-> why a pool on `device` cannot take KV by `backend`, or None when it can."""
    entry = PAIR_BACKENDS.get(backend)
    return f"unknown torch.distributed backend {backend!r}" if entry is None else entry.refuses(device)


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


def _build(backend: str, store: dist.Store, key: str, rank: int, host: str, timeout: datetime.timedelta,
           pair: bytes, secret: bytes) -> DistPayload:
    """Both ranks call this; it returns once both have joined (or raises after `timeout`).
    pair: the pair's identity (pair_grant.identity): the sender proves it, the receiver
    checks the proof before it joins (with a secret: $TANDEM_KV_SECRET; else neither)."""
    entry = PAIR_BACKENDS[backend]
    prefixed = dist.PrefixStore(f"kv-pair/{key}/", store)
    if rank == SENDER_RANK:
        pair_grant.prove(prefixed, pair, secret)
    else:  # NOTE: before the group exists: an unproven joiner never joins
        pair_grant.check(prefixed, pair, secret, timeout)
    group = entry.build(prefixed, rank, timeout, host)
    return DistPayload(group, rank, backend, entry.device(), timeout.total_seconds(), entry.empty, entry.polled)


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

    def offer(self, backend: str, sender: bytes = b"") -> tuple[dict[str, Any], concurrent.futures.Future]:
        """-> (the HELLO_OK fields that tell the sender where to meet, the receiver's half
        of the pair: a DistPayload once the sender has joined). sender: its ZMQ identity."""
        store = self._ensure_store()
        key = uuid.uuid4().hex
        pair = pair_grant.identity(key, backend, str(self._port), sender.hex())
        future = self._pool.submit(_build, backend, store, key, RECEIVER_RANK, self.host, self.timeout, pair,
                                   pair_grant.secret())
        return {"backend": backend, "store_port": self._port, "key": key, "peer": sender.hex()}, future

    def closed_by_sender(self, key: str) -> bool:
        """Whether the sender of pair `key` has closed its side (see DistPayload.close)."""
        store = self._store
        return store is not None and dist.PrefixStore(f"kv-pair/{key}/", store).check([CLOSED_KEY])

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
        self._keys: dict[bytes, str] = {}

    def __contains__(self, sender: bytes) -> bool:
        return sender in self._pairs

    def offer(self, sender: bytes, backend: str) -> dict[str, Any]:
        """A new pair with `sender` (replacing any before) -> the HELLO_OK fields for it.
        Raises OSError or RuntimeError when no rendezvous can be hosted."""
        if self._host is None:
            self._host = PairHost(self._address, self._timeout_s)
        self.forget(sender)
        self._forget_closed()
        fields, self._pairs[sender] = self._host.offer(backend, sender)
        self._keys[sender] = fields["key"]
        return fields

    def _forget_closed(self) -> None:
        """Destroy the pairs whose senders closed their side, or that never formed (a sender
        that shook hands again comes back with a new identity: its old pair would otherwise
        live on)."""
        host = self._host
        for sender, key in list(self._keys.items()):
            future = self._pairs[sender]
            failed = future.done() and (future.cancelled() or future.exception() is not None)
            if failed or (host is not None and host.closed_by_sender(key)):
                self.forget(sender)

    def payload(self, sender: bytes) -> DistPayload:
        """This side of `sender`'s pair, waiting for it to be built (the sender has built its
        own before it sends, so it is all but done). Raises when it could not be built."""
        return self._pairs[sender].result(timeout=self._timeout_s)

    def forget(self, sender: bytes) -> None:
        """Destroy `sender`'s pair (it broke, or the sender shook hands again)."""
        self._keys.pop(sender, None)
        future = self._pairs.pop(sender, None)
        if future is not None:
            # NOTE: a pair still being built is destroyed once built (or never was).
            future.add_done_callback(_close_built)

    def close(self) -> None:
        for sender in list(self._pairs):
            self.forget(sender)
        if self._host is not None:
            self._host.close()


def _close_built(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class _StoreClients:
    """The sender's connection to each receiver's rendezvous store, kept across its pairs.

    Why: a TCPStore client connect costs a TCP handshake and, in torch, a reverse lookup of
    the peer's address (getnameinfo, which asks DNS for an IPv4-mapped loopback or any
    address outside /etc/hosts); a resolver that drops a query stalls that connect for its
    5 s timeout, past the pair's own. One connection per receiver makes a reconnect storm
    one connect, not one per handshake. Bounded: the oldest is dropped past MAX_CLIENTS."""

    MAX_CLIENTS = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, int, float], dist.TCPStore] = {}

    def client(self, host: str, port: int, timeout: datetime.timedelta) -> tuple[dist.TCPStore, bool]:
        """-> (the store's client, whether it was kept from an earlier pair)."""
        key = (host, port, timeout.total_seconds())
        with self._lock:
            store = self._clients.get(key)
        if store is not None:
            return store, True
        # (connect outside the lock: it may take up to `timeout`)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        with self._lock:
            store = self._clients.setdefault(key, store)
            while len(self._clients) > self.MAX_CLIENTS:
                self._clients.pop(next(iter(self._clients)))
        return store, False

    def drop(self, host: str, port: int, store: dist.TCPStore) -> None:
        """Forget `store` (its receiver may be gone); pairs still using it keep it alive."""
        with self._lock:
            for key in [k for k, v in self._clients.items() if k[:2] == (host, port) and v is store]:
                del self._clients[key]


_RENDEZVOUS = _StoreClients()


def join_pair(address: str, offer: dict[str, Any], timeout_s: float) -> DistPayload:
    """The sender's half: join the pair the receiver at `address` offered in its HELLO_OK.
    Raises RuntimeError (or ValueError on a bad offer) when the pair cannot be made."""
    backend, port, key, peer = offer.get("backend"), offer.get("store_port"), offer.get("key"), offer.get("peer", "")
    if backend not in PAIR_BACKENDS or not isinstance(port, int) or not isinstance(key, str) or not key.isalnum() \
            or not isinstance(peer, str):
        raise ValueError(f"a bad torch.distributed offer from {address}: {offer!r}")
    host = address_host(address)
    timeout = datetime.timedelta(seconds=min(timeout_s, MAX_WAIT_S))
    store, kept = _RENDEZVOUS.client(host, port, timeout)
    while True:
        try:
            pair = _build(backend, store, key, SENDER_RANK, route_to(host), timeout,
                          pair_grant.identity(key, backend, str(port), peer), pair_grant.secret())
            break
        except Exception as e:
            _RENDEZVOUS.drop(host, port, store)  # (a receiver gone or restarted: connect afresh next time)
            # A kept connection to a receiver since gone, whose port a new receiver (this offer's)
            # now listens on, fails at once (a broken pipe): once more on a fresh connection.
            if not (kept and isinstance(e, dist.DistNetworkError)):
                raise
            store, kept = _RENDEZVOUS.client(host, port, timeout)
    # The sender's close tells the receiver, whose side is destroyed at its next handshake.
    prefixed = dist.PrefixStore(f"kv-pair/{key}/", store)
    # torch's stubs type Store.set's value as str; the store takes bytes too.
    pair.on_close = lambda: prefixed.set(CLOSED_KEY, b"1")  # type: ignore[arg-type]
    return pair
