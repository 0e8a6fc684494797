"""Two pools on one GPU (or two GPUs of a node with peer access): the decode worker's pool
exported by CUDA IPC, written in place by the prefill worker, device to device.

torch's CUDA tensor sharing between processes, without pickle: the receiver calls
`_share_cuda_` on its pool's storage at a handshake that takes this path and sends the
result in the HELLO_OK as msgpack bytes and ints (IpcHandle); the sender validates it and
opens it with `UntypedStorage._new_shared_cuda` (what torch.multiprocessing's
rebuild_cuda_tensor does). Each handshake gets an export of its own: the producer's
ref-counter slot then counts one consumer, whose storage's deleter releases it.

The grants and the fence are the host shared-memory path's (fence.py), in a file with no
pool bytes in it (shared_pool.FenceFile): both processes are on one host, so the OFD lock
excludes them alike. NOTE: a device copy is asynchronous: the sender synchronizes its copy
inside the fence's lock (in_place.py), so that once the receiver's revoke returns no byte
lands in the blocks, and the LAYER header goes out only after its rows are in the pool.

Nothing here touches CUDA at import: a CPU-only process imports it and never takes the path.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tandem.kvtransfer.fence import GrantFence
from tandem.kvtransfer.payload import TORCH_DTYPES
from tandem.kvtransfer.protocol import KVLayout, ProtocolError
from tandem.kvtransfer.shared_pool import SHM_DIR, FenceFile, MappedFence, pool_bytes

logger = logging.getLogger(__name__)

MAX_HANDLE_BYTES = 1024
"""A cudaIpcMemHandle is 64 bytes (an expandable segment's handle more): more is malformed."""
MAX_COUNTER_NAME_BYTES = 256
"""The producer's ref-counter file name (a /dev/shm name)."""
MAX_OFFSET = 1 << 48


def device_identity(device: torch.device, node_id: str) -> str:
    """A pool's CUDA device, the same in every process that sees it: its GPU's UUID, else
    "<node>/<index>" (an index is only meaningful within one process's visible devices);
    "" off CUDA."""
    if device.type != "cuda":
        return ""
    if not torch.cuda.is_available():  # (a fake CUDA tensor's device, in tests)
        return f"{node_id}/{device.index or 0}"
    index = torch.cuda.current_device() if device.index is None else device.index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid else f"{node_id}/{index}"


def local_index(identity: str, node_id: str) -> int | None:
    """The index, among this process's visible devices, of the device named `identity`, or None."""
    if not identity or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if device_identity(torch.device("cuda", index), node_id) == identity:
            return index
    return None


def can_peer_access(own: torch.device, other: str, node_id: str) -> bool:
    """Whether this process's GPU `own` can write the visible GPU named `other` directly."""
    index = local_index(other, node_id)
    if own.type != "cuda" or index is None:
        return False
    own_index = torch.cuda.current_device() if own.index is None else own.index
    return index == own_index or bool(torch.cuda.can_device_access_peer(own_index, index))


@dataclass(frozen=True)
class IpcHandle:
    """A device pool's CUDA IPC export, as it crosses the wire in the HELLO_OK (`cuda_ipc`):
    the storage's `_share_cuda_` tuple without its device index (the sender finds the device
    by its identity among its own)."""

    handle: bytes
    """The cudaIpcMemHandle of the allocation that holds the pool."""
    size: int
    """The pool storage's bytes (its layout's, exactly)."""
    offset: int
    """Where the pool's storage starts in that allocation."""
    ref_counter: bytes
    """The producer's ref-counter file, which the sender's storage releases when freed."""
    ref_counter_offset: int
    event: bytes | None
    """An IPC event the sender's stream waits on before the first write, when event_sync."""
    event_sync: bool

    def as_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, fields: Any, layout: KVLayout) -> IpcHandle:
        """A HELLO_OK's `cuda_ipc`, checked for a pool of `layout`; ProtocolError otherwise."""
        if not isinstance(fields, dict) or set(fields) != set(cls.__dataclass_fields__):
            raise ProtocolError("malformed", f"cuda_ipc needs exactly {sorted(cls.__dataclass_fields__)}")

        def check_bytes(name: str, limit: int, can_be_none: bool = False) -> None:
            value = fields[name]
            if can_be_none and value is None:
                return
            if not isinstance(value, bytes) or not 0 < len(value) <= limit:
                raise ProtocolError("malformed", f"cuda_ipc {name} must be 1 to {limit} bytes")

        check_bytes("handle", MAX_HANDLE_BYTES)
        check_bytes("ref_counter", MAX_COUNTER_NAME_BYTES)
        check_bytes("event", MAX_HANDLE_BYTES, can_be_none=True)
        for name in ("size", "offset", "ref_counter_offset"):
            value = fields[name]
            if type(value) is not int or not 0 <= value < MAX_OFFSET:
                raise ProtocolError("malformed", f"cuda_ipc {name} must be an integer in [0, 2**48)")
        if not isinstance(fields["event_sync"], bool) or (fields["event_sync"] and fields["event"] is None):
            raise ProtocolError("malformed", "cuda_ipc event_sync must be a boolean (with an event when true)")
        if fields["size"] != pool_bytes(layout):
            raise ProtocolError("malformed", f"cuda_ipc exports {fields['size']} bytes, a pool of {layout} "
                                f"holds {pool_bytes(layout)}")
        return cls(**fields)


def _as_bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else None if value is None else bytes(value)


def export_pool(kv_cache: torch.Tensor) -> IpcHandle:
    """A new CUDA IPC export of the pool (which must be its storage, whole)."""
    storage = kv_cache.untyped_storage()
    _, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
    return IpcHandle(_as_bytes(handle) or b"", int(size), int(offset), _as_bytes(counter) or b"",
                     int(counter_offset), _as_bytes(event), bool(event_sync))


def pool_view(storage: torch.UntypedStorage, layout: KVLayout) -> torch.Tensor:
    """The pool tensor over `storage` ([layers, 2, blocks, block_size, kv_heads, head_dim])."""
    shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    # torch's stubs want a stride alongside the size; set_ takes the size alone (contiguous).
    return torch.empty(0, dtype=TORCH_DTYPES[layout.dtype], device=storage.device).set_(  # type: ignore[call-overload]
        storage, 0, shape)


def open_pool(ipc: IpcHandle, layout: KVLayout, device_index: int) -> torch.Tensor:
    """The exported pool, opened in this process on its device (`device_index`, this
    process's numbering). RuntimeError when CUDA cannot open it."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(device_index, ipc.handle, ipc.size, ipc.offset, ipc.ref_counter,
                                                    ipc.ref_counter_offset, ipc.event, ipc.event_sync)
    return pool_view(storage, layout)


class DevicePoolExport:
    """The receiver's side: its pool on a GPU, offered by CUDA IPC, and its grant table."""

    path = "cuda_ipc"

    def __init__(self, kv_cache: torch.Tensor, fence_file: FenceFile, device: str) -> None:
        self.kv_cache = kv_cache
        self._file = fence_file
        self.device = device
        """The pool's device identity (device_identity)."""

    @classmethod
    def create(cls, kv_cache: torch.Tensor, layout: KVLayout, node_id: str,
               directory: str = SHM_DIR) -> DevicePoolExport | None:
        """The export of `kv_cache` (a whole storage on CUDA), or None (logged) when it
        cannot be offered: not one whole storage, or no room for its grant table."""
        if kv_cache.device.type != "cuda" or kv_cache.storage_offset() or not kv_cache.is_contiguous() \
                or kv_cache.untyped_storage().nbytes() != pool_bytes(layout):
            logger.warning("kv pool on %s is not one whole storage: no CUDA IPC transfers", kv_cache.device)
            return None
        fence_file = FenceFile.create(layout, directory)
        if fence_file is None:
            return None
        return cls(kv_cache, fence_file, device_identity(kv_cache.device, node_id))

    @property
    def name(self) -> str:
        return self._file.name

    @property
    def num_bytes(self) -> int:
        return self._file.num_bytes

    @property
    def fence(self) -> GrantFence:
        return self._file.fence

    def export(self) -> dict[str, Any]:
        """The HELLO_OK fields for one sender that takes the path: a fresh IPC export."""
        return {"cuda_ipc": export_pool(self.kv_cache).as_wire()}

    def close(self) -> None:
        self._file.close()


class DeviceTarget:
    """The sender's side: the receiver's GPU pool opened here (an in_place.InPlaceTarget)."""

    path = "cuda_ipc"

    def __init__(self, fence_file: MappedFence, kv_cache: torch.Tensor) -> None:
        self._file = fence_file
        self.layout = fence_file.layout
        self.kv_cache = kv_cache

    @classmethod
    def open(cls, fence_file: MappedFence, fields: Any, device: str, node_id: str) -> DeviceTarget:
        """Open the pool a HELLO_OK exports (`fields`) on the device named `device`.
        ProtocolError for a malformed export; ValueError or RuntimeError when it cannot be
        opened here. Takes `fence_file` only when it returns."""
        ipc = IpcHandle.from_wire(fields, fence_file.layout)
        index = local_index(device, node_id)
        if index is None:
            raise ValueError(f"this process does not see the receiver's GPU {device}")
        return cls(fence_file, open_pool(ipc, fence_file.layout, index))

    @property
    def fence(self) -> GrantFence:
        return self._file.fence

    def owner_alive(self) -> bool:
        return self._file.owner_alive()

    def close(self) -> None:
        """Let go of the grant table; the pool's mapping goes with the last tensor over it."""
        self._file.close()
