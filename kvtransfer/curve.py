"""Optional CurveZMQ encryption and authentication of the KV sockets, keyed by one cluster secret.

Every worker of a cluster derives the same two keypairs from the secret (TANDEM_KV_SECRET):
receivers serve with the server pair, senders connect with the client pair, and a receiver's
ZAP handler admits only the client key. Whoever lacks the secret can neither read the KV on
the wire nor complete a handshake. Rows written in place through a same-node shared pool and
rows sent by torch.distributed (gloo, NCCL) do not pass through these sockets.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)

SECRET_ENV = "TANDEM_KV_SECRET"
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class CurveKeys:
    """The Z85-encoded CurveZMQ keys every worker of a cluster derives from its secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the KV secret must have at least {MIN_SECRET_CHARS} characters")
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: KV encryption is unavailable")
        server_public, server_secret = _keypair(secret, b"kv-server")
        client_public, client_secret = _keypair(secret, b"kv-client")
        return cls(server_public, server_secret, client_public, client_secret)

    @classmethod
    def from_env(cls) -> CurveKeys | None:
        """The keys of $TANDEM_KV_SECRET, or None (plain sockets) when it is unset or empty."""
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            return None
        logger.info("KV sockets: CurveZMQ with the keys of $%s", SECRET_ENV)
        return cls.from_secret(secret)

    def serve(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server with the cluster's server keys."""
        socket.curve_server = True
        socket.curve_publickey = self.server_public
        socket.curve_secretkey = self.server_secret

    def connect(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it connects) a CURVE client of the cluster's receivers."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret

    def authenticator(self, context: zmq.Context, on_denied: Callable[[], None],
                      kind: type[Authenticator] = ThreadAuthenticator) -> Authenticator:
        """A started ZAP handler on `context` that admits only the cluster's client key;
        `on_denied` runs (on its thread, or its event loop for an AsyncioAuthenticator on an
        asyncio context) for each handshake with another key."""
        auth = kind(context, log=logger)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OnlyKey(self.client_public, on_denied))
        return auth


@dataclass(frozen=True)
class _OnlyKey:
    """pyzmq's credentials provider: a handshake is admitted when its client key is this one."""

    client_public: bytes
    on_denied: Callable[[], None]

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        self.on_denied()
        return False


def _keypair(secret: str, role: bytes) -> tuple[bytes, bytes]:
    """-> (public, secret) Z85 keys: the secret key is a keyed hash of the cluster secret."""
    secret_key = z85.encode(hashlib.blake2b(secret.encode(), digest_size=32, person=b"tandem-curve",
                                            salt=role.ljust(16, b"\0")).digest())
    return zmq.curve_public(secret_key), secret_key
