"""The receiver's side of the handshake: whether a sender may send KV here at all, and by
which path (frames, torch.distributed, or written in place into the shared pool)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from tandem.kvtransfer.fence import GrantFence
from tandem.kvtransfer.path_choice import ALLOW_UNENCRYPTED_FLAG
from tandem.kvtransfer.protocol import KVLayout

logger = logging.getLogger(__name__)


class SharedPool(Protocol):
    """A receiver's pool offered to same-node senders to write in place: in host shared
    memory (shared_pool.HostSharedPool) or on a GPU by CUDA IPC (cuda_ipc.DevicePoolExport)."""

    @property
    def path(self) -> str:
        """"shm" or "cuda_ipc": the path a sender names in its HELLO (`in_place`) to take it."""
        ...

    @property
    def device(self) -> str:
        """The pool's CUDA device identity ("" in host memory)."""
        ...

    @property
    def name(self) -> str:
        """Its file in shared memory (the pool and its grant table, or the grant table alone)."""
        ...

    @property
    def num_bytes(self) -> int:
        """That file's size, which the sender's offer must name."""
        ...

    @property
    def kv_cache(self) -> Any: ...

    @property
    def fence(self) -> GrantFence: ...

    def export(self) -> dict[str, Any]:
        """The HELLO_OK fields a sender needs to open the pool (besides its name)."""
        ...

    def close(self) -> None:
        """Release the pool's file (and, for host memory, its mapping)."""
        ...


def in_place_reply(hello: dict[str, Any], pool: SharedPool) -> dict[str, Any] | None:
    """The HELLO_OK fields that let this sender write `pool` in place, or None: its offer
    must be this very file (name and size), by this pool's path; CUDA IPC only for a sender
    on the pool's GPU, or one that says it reaches that GPU by peer access.
    NOTE: no other sender is ever sent the IPC handle."""
    if hello.get("shm_pool") != pool.name or hello.get("shm_bytes") != pool.num_bytes \
            or hello.get("in_place", "shm") != pool.path:
        return None
    if pool.path == "cuda_ipc" and not (hello.get("device") == pool.device
                                        or hello.get("peer_access") is True and hello.get("device")):
        return None
    try:
        exported = pool.export()
    except RuntimeError as e:  # CUDA would not export it: the sender sends frames instead
        logger.warning("kv receiver cannot export its pool by %s: %s", pool.path, e)
        return None
    return {"shm_pool": pool.name, **exported}


def answer_hello(hello: dict[str, Any], layout: KVLayout, model: str | None, dist_rank: int | None,
                 shared_pool: SharedPool | None, pair_refused: Callable[[str], str | None] | None = None,
                 device: str = "", unencrypted_pairs_refused: bool = False) -> tuple[str | None, dict[str, Any]]:
    """-> (why the sender is refused, or None; the HELLO_OK fields otherwise). The reply
    names the pool (`shm_pool`, with a CUDA IPC export `cuda_ipc` for a pool on a GPU) when
    the sender offered to write into it in place and its offer is this very pool
    (in_place_reply). ProtocolError on a bad layout.

    pair_refused: why this receiver cannot take KV by a given torch.distributed backend in a
    pair (None: it can); the reply then carries `dist_pair` (the caller fills in where to meet).
    A sender that offered a pair this receiver cannot take is refused only when it required it.
    device: this receiver's pool's CUDA device identity: never a pair with a sender on it.
    unencrypted_pairs_refused: TANDEM_KV_SECRET is set here and the operator did not
    acknowledge unencrypted pairs (path_choice.ALLOW_UNENCRYPTED_FLAG): no pair at all."""
    theirs = KVLayout.from_dict(hello.get("layout"))
    why = layout.incompatibility(theirs)
    if why is None and model is not None and hello.get("model") != model:
        why = f"model differs: receiver serves {model!r}, sender {hello.get('model')!r}"
    if why is None and ("dist_rank" in hello) != (dist_rank is not None):
        why = "one side sends KV on torch.distributed, the other expects it in ZMQ frames"
    pair = hello.get("dist_pair")
    take_pair = False
    if why is None and pair is not None:
        cannot = (f"both pools on one GPU ({device}), where NCCL allows one rank per device"
                  if device and hello.get("device") == device
                  else "TANDEM_KV_SECRET is set and a torch.distributed pair is not encrypted "
                       f"({ALLOW_UNENCRYPTED_FLAG} allows it)" if unencrypted_pairs_refused
                  else "no torch.distributed here" if pair_refused is None else pair_refused(str(pair)))
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
    in_place = None if shared_pool is None or take_pair else in_place_reply(hello, shared_pool)
    reply.update(in_place or {})
    return None, reply
