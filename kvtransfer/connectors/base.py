"""The connector interface: one class per data path, both halves of it.

A connector is chosen per pair (path_choice.choose_path names it), and lives three times:
- at the handshake, the sender's half: `hello` adds the fields that ask for the path, `open`
  turns the receiver's HELLO_OK into the sender's SendPath (or None: declined, frames then);
- at the handshake, the receiver's half: `answer` (a class method) takes a HELLO that asks
  for the path, and gives the HELLO_OK fields with the receiver's ReceivePath for that sender;
- per layer: SendPath.send_layer moves the rows, ReceivePath.rows takes them in.
What every path shares (the reservation, the grant, headers, acks, timeouts) stays with
KVSender and KVReceiver, which never ask which path a pair took.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import zmq

from tandem.kvtransfer.protocol import Destination, KVLayout, LayerHeader, ProtocolError

if TYPE_CHECKING:
    from tandem.kvtransfer.dist_pairs import ReceiverPairs
    from tandem.kvtransfer.handshake import SharedPool
    from tandem.kvtransfer.outgoing import Outgoing
    from tandem.kvtransfer.staging import Staging


class PathBroken(ProtocolError):
    """A sender's data path broke mid-message (its torch.distributed peer is gone): every
    request of that sender fails, and it must shake hands again."""

    def __init__(self, detail: str) -> None:
        super().__init__("peer_lost", detail)
        self.detail = detail


class CorruptPayload(ProtocolError):
    """A message's rows were corrupted on the way: its request fails, the others are unharmed."""

    def __init__(self, detail: str) -> None:
        super().__init__("checksum", detail)


@dataclass(frozen=True)
class SenderSide:
    """What a connector's sender half knows as it shakes hands with one receiver."""

    address: str
    destination: Destination | None
    """One of the receiver's (None: a receiver known by address alone)."""
    node_id: str
    device: str
    """The sender's pool's CUDA device identity (cuda_ipc.device_identity; "" in host memory)."""
    transport: str
    """What the operator asked for (registry.kv_transports())."""
    timeout_s: float


@dataclass(frozen=True)
class ReceiverSide:
    """What a connector's receiver half knows as it answers a HELLO."""

    layout: KVLayout
    device: str
    """The pool's CUDA device identity ("" in host memory)."""
    pool_device: torch.device
    shared_pool: SharedPool | None
    """The pool offered to same-node senders to write in place, if any."""
    pairs: ReceiverPairs
    unencrypted_pairs_refused: bool
    """TANDEM_KV_SECRET is set and unencrypted torch.distributed pairs were not acknowledged."""


@dataclass(frozen=True)
class Answer:
    """A receiver half's answer to a HELLO that asked for its path."""

    fields: dict[str, Any]
    """Its HELLO_OK fields (besides the layout)."""
    path: ReceivePath | None
    """How this sender's rows come in (None when refused)."""
    refused: str = ""
    """Why the sender is refused (it required the path, which cannot be had here)."""


@dataclass
class LayerJob:
    """One send_layer call, its range checked and its header built (the fields every path sends)."""

    out: Outgoing
    layer: int
    start: int
    end: int
    header: dict[str, Any]
    rows: tuple[torch.Tensor, torch.Tensor] | None
    """K and V rows given by the caller ([tokens, kv_heads, head_dim]), else read from the pool."""
    num_bytes: int

    @property
    def request_id(self) -> str:
        return self.out.destination.request_id


class SenderLink(Protocol):
    """What a SendPath may use of its sender (KVSender), on the sender's thread."""

    kv_cache: torch.Tensor
    layout: KVLayout
    checksum: bool
    staging: Staging | None

    def send_message(self, request_id: str, frames: list) -> bool:
        """The request's message to its receiver's socket (never blocks). -> False when the
        receiver cannot take it: the request has failed then."""

    def fail(self, request_id: str, reason: str) -> None:
        """End the request FAILED (its event once ZMQ lets go of its frames)."""

    def lose_peer(self, request_id: str, reason: str) -> None:
        """The request's peer broke: every request to it fails."""

    def count_sent(self, num_bytes: int) -> None:
        """KV payload bytes handed to the transport, for the metrics."""


class SendPath(ABC):
    """The sender's half of a pair's data path, owned by the sender's thread."""

    label: str
    """The path's name in metrics and logs (registry.ConnectorEntry.label)."""

    @abstractmethod
    def send_layer(self, link: SenderLink, job: LayerJob) -> bool:
        """Send the job's rows and its header. -> False when the request is no longer sent."""

    def begin(self, out: Outgoing, block_size: int) -> None:
        """A request to this receiver begins (ValueError for a destination the path cannot serve)."""

    def flush(self, link: SenderLink) -> None:
        """Send what waited for rows on their way (polled often; never blocks)."""

    def busy(self) -> bool:
        """Whether messages still wait in `flush` (a path closed while busy is flushed until not)."""
        return False

    def orphaned(self) -> bool:
        """Whether the receiver's pool, mapped here, has no owner any more."""
        return False

    def close(self) -> None:
        """Let go of what the path holds (a mapping, a pair). Idempotent."""


class ReceivePath(ABC):
    """The receiver's half of one sender's data path, used by the receiver's I/O thread."""

    label: ClassVar[str]

    @abstractmethod
    def rows(self, h: LayerHeader, frames: list[zmq.Frame], msg: dict[str, Any], layout: KVLayout
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """-> the K and the V rows a LAYER carries, as pieces ([n_i, *row_shape]) in token
        order (none when written in place). ProtocolError for a message that breaks the
        path's rules, PathBroken, CorruptPayload."""

    def forget(self) -> None:
        """The sender shook hands again, or its path broke: let go of what the path holds."""


class KVConnector(ABC):
    """One data path (registered in registry.py): its sender half, made per handshake, and
    its receiver half, `answer`."""

    def __init__(self, name: str, side: SenderSide) -> None:
        """name: the registry name it was chosen by (one class may serve several)."""
        self.name = name
        self.side = side

    def hello(self) -> dict[str, Any]:
        """HELLO fields that ask for this path ({}: it cannot be offered from here)."""
        return {}

    @abstractmethod
    def open(self, layout: KVLayout, reply: dict[str, Any]) -> SendPath | None:
        """The sender's path from the receiver's HELLO_OK; None when the receiver declined it
        (frames then). Raises TransferRefused when a path it agreed to cannot be made."""

    def abandon(self) -> None:
        """The handshake failed before `open`: let go of what `hello` took."""

    @classmethod
    @abstractmethod
    def answer(cls, name: str, hello: dict[str, Any], side: ReceiverSide, sender: bytes) -> Answer | None:
        """The receiver's answer to a HELLO that asks for path `name`; None when it does not
        ask for it, or the receiver declines (another path, frames at last, answers)."""


def check_rows(h: LayerHeader, layout: KVLayout) -> None:
    """The header's rows are the pool's dtype and shape (ProtocolError otherwise)."""
    if h.dtype != layout.dtype:
        raise ProtocolError("wrong_dtype", f"{h.request_id}: {h.dtype}, the pool holds {layout.dtype}")
    if h.row_shape != (layout.num_kv_heads, layout.head_dim):
        raise ProtocolError("wrong_shape", f"{h.request_id}: rows of {h.row_shape}")


def not_negotiated(h: LayerHeader, path: str) -> ProtocolError:
    return ProtocolError("not_negotiated", f"{h.request_id}: a LAYER that does not follow the {path} path "
                                           "its sender negotiated")
