"""The receiver's side of the handshake: whether a sender may send KV here at all, and by
which path (frames, torch.distributed, or written in place into the shared pool)."""

from __future__ import annotations

from typing import Any

from tandem.kvtransfer.protocol import KVLayout
from tandem.kvtransfer.shared_pool import HostSharedPool


def answer_hello(hello: dict[str, Any], layout: KVLayout, model: str | None, dist_rank: int | None,
                 shared_pool: HostSharedPool | None) -> tuple[str | None, dict[str, Any]]:
    """-> (why the sender is refused, or None; the HELLO_OK fields otherwise). The reply
    names the pool (`shm_pool`) when the sender offered to write into it in place and its
    offer is this very pool: its name and its file's size. ProtocolError on a bad layout."""
    theirs = KVLayout.from_dict(hello.get("layout"))
    why = layout.incompatibility(theirs)
    if why is None and model is not None and hello.get("model") != model:
        why = f"model differs: receiver serves {model!r}, sender {hello.get('model')!r}"
    if why is None and ("dist_rank" in hello) != (dist_rank is not None):
        why = "one side sends KV on torch.distributed, the other expects it in ZMQ frames"
    if why is not None:
        return why, {}
    reply: dict[str, Any] = {"layout": layout.as_dict()}
    if dist_rank is not None:
        reply["dist_rank"] = dist_rank
    pool = shared_pool
    if pool is not None and hello.get("shm_pool") == pool.name and hello.get("shm_bytes") == pool.num_bytes:
        reply["shm_pool"] = pool.name
    return None, reply
