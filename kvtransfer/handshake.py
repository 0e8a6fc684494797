"""The receiver's side of the handshake: whether a sender may send KV here at all, and by
which path (frames, torch.distributed, or written in place into the shared pool)."""

from __future__ import annotations

from typing import Any, Callable

from tandem.kvtransfer.protocol import KVLayout
from tandem.kvtransfer.shared_pool import HostSharedPool


def answer_hello(hello: dict[str, Any], layout: KVLayout, model: str | None, dist_rank: int | None,
                 shared_pool: HostSharedPool | None, pair_refused: Callable[[str], str | None] | None = None
                 ) -> tuple[str | None, dict[str, Any]]:
    """-> (why the sender is refused, or None; the HELLO_OK fields otherwise). The reply
    names the pool (`shm_pool`) when the sender offered to write into it in place and its
    offer is this very pool: its name and its file's size. ProtocolError on a bad layout.

    pair_refused: why this receiver cannot take KV by a given torch.distributed backend in a
    pair (None: it can); the reply then carries `dist_pair` (the caller fills in where to meet).
    A sender that offered a pair this receiver cannot take is refused only when it required it."""
    theirs = KVLayout.from_dict(hello.get("layout"))
    why = layout.incompatibility(theirs)
    if why is None and model is not None and hello.get("model") != model:
        why = f"model differs: receiver serves {model!r}, sender {hello.get('model')!r}"
    if why is None and ("dist_rank" in hello) != (dist_rank is not None):
        why = "one side sends KV on torch.distributed, the other expects it in ZMQ frames"
    pair = hello.get("dist_pair")
    take_pair = False
    if why is None and pair is not None:
        cannot = "no torch.distributed here" if pair_refused is None else pair_refused(str(pair))
        if cannot is not None and hello.get("dist_required"):
            why = f"KV by torch.distributed {pair!r} was required: {cannot}"
        take_pair = cannot is None
    if why is not None:
        return why, {}
    reply: dict[str, Any] = {"layout": layout.as_dict()}
    if take_pair:
        reply["dist_pair"] = {"backend": pair}
    if dist_rank is not None:
        reply["dist_rank"] = dist_rank
    pool = shared_pool
    if pool is not None and not take_pair and hello.get("shm_pool") == pool.name and hello.get("shm_bytes") == pool.num_bytes:
        reply["shm_pool"] = pool.name
    return None, reply
