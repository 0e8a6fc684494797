"""The proof a torch.distributed pair's rendezvous asks for when $TANDEM_KV_SECRET is set:
an HMAC-SHA256, keyed by the secret, over the pair's identity as the handshake knows it.

Why: the receiver's TCPStore listens for anyone who reaches it, and a process group joins
whoever writes the right keys first. With the secret set, the sender writes the proof into
the store before joining, and the receiver checks it before it builds its half of the group:
a joiner without the secret is refused, and no group is ever made with it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os

import torch.distributed as dist

from tandem.kvtransfer.curve import SECRET_ENV

GRANT_KEY = "grant"
"""The store key (under the pair's prefix) the sender writes its proof at."""


class PairRefused(RuntimeError):
    """A joiner did not prove the pair's grant: the rendezvous was abandoned, nothing joined."""


def secret() -> bytes:
    """$TANDEM_KV_SECRET as bytes (empty: no proof is asked for)."""
    return os.environ.get(SECRET_ENV, "").encode()


def identity(key: str, backend: str, receiver: str, sender: str) -> bytes:
    """The pair's identity: its fresh key, its backend, the receiver's rendezvous address
    (rank 1) and the sender's ZMQ identity as the receiver saw it (rank 0)."""
    return "\n".join(("tandem-kv-pair/1", key, backend, f"rank1={receiver}", f"rank0={sender}")).encode()


def proof(key: bytes, pair: bytes) -> str:
    """HMAC-SHA256 of `pair` keyed by `key`, in hex."""
    return hmac.new(key, pair, hashlib.sha256).hexdigest()


def prove(store: dist.Store, pair: bytes, key: bytes) -> None:
    """The sender's side: write the proof for `pair` with secret `key` (none: nothing)."""
    if key:
        store.set(GRANT_KEY, proof(key, pair))


def check(store: dist.Store, pair: bytes, key: bytes, timeout: datetime.timedelta) -> None:
    """The receiver's side, before it joins: wait for the sender's proof and compare it in
    constant time with the one secret `key` gives (none: nothing is asked for). Raises
    PairRefused (a wrong proof, or none within `timeout`)."""
    if not key:
        return
    try:
        store.wait([GRANT_KEY], timeout)
    except RuntimeError:  # (torch's DistStoreError: no proof came)
        raise PairRefused("no grant proof for the torch.distributed pair within "
                          f"{timeout.total_seconds():.0f} s") from None
    if not hmac.compare_digest(store.get(GRANT_KEY), proof(key, pair).encode()):
        raise PairRefused("the torch.distributed pair's grant proof is wrong: not joined")
