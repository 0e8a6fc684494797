"""The transfer protocol's messages: a msgpack header (never pickle) plus raw tensor frames.

Every message on the wire is a ZMQ multipart message whose first frame is a msgpack map
with at least `v` (PROTOCOL_VERSION), `kind` (MessageKind) and `request_id`; LAYER
messages are followed by the K frames and then the V frames of their payload (or, on the
torch.distributed data path, by nothing: the tensors follow on the process group; or, on
the shared-memory path, by nothing: the rows are in the receiver's pool already). The
prefix fetch's messages (FETCH to PULLED) are fetch_messages.py's.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from tandem.config.names import DTYPE_BYTES as ITEM_SIZES
from tandem.config.names import DTYPE_NAMES as DTYPES

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20

class ProtocolError(ValueError):
    """A message that does not follow the protocol; the `reason` names the counter it bumps."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class TransferRefused(RuntimeError):
    """The receiver refused the handshake (incompatible KV layouts, protocol version)."""


class PairNotFormed(TransferRefused):
    """The torch.distributed pair both sides agreed to in the handshake did not form (a side
    slow to join under load, or gone): no refusal of the request, worth one more handshake."""


class MessageKind(enum.IntEnum):
    HELLO = 1  # sender -> receiver: the sender's layout (and model, when it names one)
    HELLO_OK = 2  # receiver -> sender: the receiver's layout
    REFUSED = 3  # receiver -> sender: the handshake failed, with the reason
    LAYER = 4  # sender -> receiver: one layer's K and V for a token range of a request
    ABORT = 5  # either way: forget this request
    DONE = 6  # receiver -> sender: every layer of the request arrived
    FAILED = 7  # receiver -> sender: the request failed on the receiver (reason given)
    FETCH = 8  # worker -> another's tier server: the prefix blocks it asks for (tier_peer.py)
    OFFER = 9  # tier server -> worker: how many of them, from the first, it holds for the worker
    PULL = 10  # worker -> tier server: send the offered blocks to this Destination
    PULLED = 11  # tier server -> worker: the transfer ended (DONE at the receiver, or why not)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one worker's KV pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    Crosses the wire in the handshake. Sender and receiver must agree on everything but
    num_blocks and block_size.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """The pool's element type, one of DTYPES: the KV cache's dtype (--kv-cache-dtype), which may
    differ from the model's activations'. Rows cross as these bytes, never converted."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * ITEM_SIZES[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        fields = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")
        if not isinstance(d, dict) or any(not isinstance(d.get(f), int) or d[f] < 1 for f in fields):
            raise ProtocolError("malformed", f"layout needs positive integers {fields}: {d!r}")
        if d.get("dtype") not in DTYPES:
            raise ProtocolError("malformed", f"layout dtype must be one of {DTYPES}: {d.get('dtype')!r}")
        return cls(**{f: d[f] for f in (*fields, "dtype")})

    def incompatibility(self, other: KVLayout) -> str | None:
        """Why KV of `other` cannot be written into this pool, or None when it can."""
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                # NOTE: a dtype is refused, not converted: the rows land byte for byte (in place,
                # by NCCL, as frames), and both pools are sized by it.
                hint = (": KV cache dtypes must match (give both pools the same --kv-cache-dtype)"
                        if field == "dtype" else "")
                return f"{field} differs: receiver has {mine}, sender has {theirs}{hint}"
        return None


@dataclass(frozen=True)
class LayerHeader:
    """One layer's K and V for tokens [token_start, token_start + num_tokens) of a request."""

    request_id: str
    layer: int
    token_start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    """The receiver's blocks covering the token range (its layout, its block size)."""
    dtype: str
    row_shape: tuple[int, int]
    """(num_kv_heads, head_dim) of each token row."""
    frame_tokens: tuple[int, ...]
    """Token rows in each K frame (the V frames split the same way); empty when the payload
    travels on torch.distributed instead of in the message."""
    crc32: int | None = None
    """CRC-32 of the payload frames in order (K frames, then V), when the sender checksums."""
    in_place: bool = False
    """The rows are written already, straight into the receiver's shared pool (a sender that
    negotiated that path in its handshake): no payload follows."""
    grant: str = ""
    """The request's Destination.grant."""


def payload_crc32(frames: Iterable[memoryview | bytes]) -> int:
    """The CRC-32 of a LAYER message's payload frames, in order."""
    crc = 0
    for frame in frames:
        crc = zlib.crc32(frame, crc)
    return crc


def encode(kind: MessageKind, request_id: str = "", **fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": int(kind), "request_id": request_id, **fields})


def decode(frame: bytes | memoryview) -> tuple[MessageKind, str, dict[str, Any]]:
    """-> (kind, request_id, the whole map); ProtocolError on anything unexpected."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError("malformed", f"header of {len(frame)} bytes")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise ProtocolError("malformed", f"header is not msgpack: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("malformed", "header is not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    try:
        raw_kind: Any = msg.get("kind")  # (whatever came: MessageKind refuses what is no kind)
        kind = MessageKind(raw_kind)
    except ValueError:
        raise ProtocolError("malformed", f"unknown message kind {msg.get('kind')!r}") from None
    request_id = msg.get("request_id")
    if not isinstance(request_id, str):
        raise ProtocolError("malformed", "request_id must be a string")
    return kind, request_id, msg


def layer_header(request_id: str, msg: dict[str, Any]) -> LayerHeader:
    """The fields of a LAYER message, type-checked (values are checked by the receiver)."""
    ints = ("layer", "token_start", "num_tokens")
    if any(not isinstance(msg.get(f), int) or msg[f] < 0 for f in ints):
        raise ProtocolError("malformed", f"LAYER needs non-negative integers {ints}")
    lists = ("block_ids", "row_shape", "frame_tokens")
    if any(not isinstance(msg.get(f), list) or not all(isinstance(x, int) for x in msg[f]) for f in lists):
        raise ProtocolError("malformed", f"LAYER needs integer lists {lists}")
    if len(msg["row_shape"]) != 2:
        raise ProtocolError("malformed", "row_shape must be (num_kv_heads, head_dim)")
    if not isinstance(msg.get("dtype"), str):
        raise ProtocolError("malformed", "dtype must be a string")
    crc = msg.get("crc32")
    if crc is not None and not (isinstance(crc, int) and 0 <= crc < 2**32):
        raise ProtocolError("malformed", "crc32 must be an unsigned 32-bit integer")
    if not isinstance(msg.get("in_place", False), bool):
        raise ProtocolError("malformed", "in_place must be a boolean")
    return LayerHeader(request_id, msg["layer"], msg["token_start"], msg["num_tokens"], tuple(msg["block_ids"]),
                       msg["dtype"], tuple(msg["row_shape"]), tuple(msg["frame_tokens"]), crc,
                       msg.get("in_place", False), grant_of(msg))


def grant_of(msg: dict[str, Any]) -> str:
    """The grant a message carries ("" when none, or not a string)."""
    grant = msg.get("grant", "")
    return grant if isinstance(grant, str) else ""


@dataclass(frozen=True)
class Destination:
    """Where a request's KV must go: handed by the receiving worker to the sending one."""

    request_id: str
    address: str
    """The receiver's ZMQ address (tcp://host:port or ipc://path)."""
    block_ids: tuple[int, ...]
    """The blocks the receiver reserved for the request, in token order."""
    num_tokens: int
    """The prompt's tokens: block_ids hold tokens [0, num_tokens)."""
    num_cached_tokens: int = 0
    """Leading tokens whose KV the receiver holds already (its prefix cache, whole blocks of
    its block size, shared with other requests): the sender sends only the tokens from
    here to num_tokens, in every layer, and must never write into the cached blocks."""
    node_id: str = ""
    """The receiving worker's node: Ray's node id under Ray, else its host's identity
    (placement.host_identity). A sender on the same node may write the KV straight into
    `shm_pool`; empty: unknown, never the same."""
    shm_pool: str = ""
    """Name of the receiver's KV pool in shared memory (shared_pool.NAME: the receiver's
    pid, the descriptor it holds the pool's unlinked file open by, a tag), for same-node
    senders to open and map; for a pool on a GPU (`device`), its grant table's file
    (shared_pool.FenceFile), the pool going by CUDA IPC; empty when the pool is private
    (sockets only)."""
    shm_grant: int = 0
    """The reservation's token in that pool's grant table: a same-node sender writes into
    the reserved blocks only while the table holds it for them (fence.py); 0 without a
    shared pool."""
    grant: str = ""
    """The reservation's secret (hex): the receiver takes LAYER and ABORT messages for the
    request only when they carry it. The router hands the Destination to the one prefill
    worker it chose, so no other peer can write (or end) this request's KV."""
    device: str = ""
    """The receiving pool's CUDA device (its GPU's UUID, else "<node>/<index>":
    cuda_ipc.device_identity); empty for a pool in host memory. With `shm_pool` (then the
    pool's grant table alone), a sender on that GPU writes the pool by CUDA IPC; no sender
    on it ever gets a torch.distributed pair (path_choice.py)."""


class TransferStatus(enum.IntEnum):
    """Where a transfer stands; ordered, so `status >= DONE` means it has ended."""

    PENDING = 0
    DONE = 1
    FAILED = 2
    ABORTED = 3  # by the receiver's owner (reported only after a revoke that had to wait)


class AbortOutcome(enum.IntEnum):
    """What a receiver's `abort` did (see KVReceiver.abort)."""

    NOT_PENDING = 0
    FENCED = 1
    """Nothing writes into the request's blocks any more: they may go back to the pool."""
    REVOKING = 2
    """A same-node writer holds them: they go back only at the request's ABORTED event."""


@dataclass(frozen=True)
class TransferEvent:
    """A transfer that ended, as either side reports it to its owner."""

    request_id: str
    status: TransferStatus
    reason: str = ""
