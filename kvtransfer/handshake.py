"""The receiver's side of the handshake: whether a sender may send KV here at all, and by
which path (the connector that answers it: connectors/)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from tandem.kvtransfer.connectors.registry import answer_order, load_connector
from tandem.kvtransfer.fence import GrantFence
from tandem.kvtransfer.protocol import KVLayout

if TYPE_CHECKING:
    from tandem.kvtransfer.connectors.base import ReceivePath, ReceiverSide


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


def answer_hello(hello: dict[str, Any], side: ReceiverSide, model: str | None, sender: bytes
                 ) -> tuple[str | None, dict[str, Any], ReceivePath | None]:
    """-> (why the sender is refused, or None; the HELLO_OK fields; how its rows come in).
    ProtocolError on a bad layout.

    Past the checks every path shares (the layouts can exchange KV, the model is the same),
    the first registered connector the HELLO asks for, and that agrees, answers: frames over
    the socket when none does (registry.answer_order())."""
    theirs = KVLayout.from_dict(hello.get("layout"))
    why = side.layout.incompatibility(theirs)
    if why is None and model is not None and hello.get("model") != model:
        why = f"model differs: receiver serves {model!r}, sender {hello.get('model')!r}"
    if why is not None:
        return why, {}, None
    for name in answer_order():
        answer = load_connector(name).answer(name, hello, side, sender)
        if answer is None:
            continue
        if answer.refused:
            return answer.refused, {}, None
        return None, {"layout": side.layout.as_dict(), **answer.fields}, answer.path
    raise AssertionError("the zmq connector answers every HELLO")
