"""The disk tier: evicted prefix blocks as files, one per block, named by the block's hash.

Layout: ``DIR/<layout key>/<hash hex>.kv``. The layout key covers what makes two pools' KV
interchangeable (the model and its weights' format, the KV dtype, block size and shape), so
workers of one model on one host that share DIR share what any of them computed, and a pool
of another model never reads them. A file is a header (magic, the block's hash, the payload's
length and its BLAKE2b checksum) and the block's KV bytes; it is written whole under another
name, then renamed, so a reader sees all of it or none. A file whose header or checksum does
not match (a flipped byte, a truncated write) is deleted and the block recomputed.

Offloads copy the block out of the pool at once (it is about to be reused) and write on a
thread of their own; a block still queued there loads from its copy. The tier keeps to its
capacity by deleting its least recently used files (files other workers wrote count once
this worker has seen them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
import time
import uuid
from collections import OrderedDict

import torch

from tandem.kvcache.kv_events import BlockEventKind, KVEventLog
from tandem.kvcache.prefix_tier import PrefixTier, TierCounters

logger = logging.getLogger(__name__)

MAGIC = b"TKVB0001"
HEADER = struct.Struct("<8s16sQ16s")
"""magic, block hash, payload bytes, payload checksum (BLAKE2b-128)."""
SHARE_ID_FILE = "share-id"
"""Beside the blocks' files: the folder's id (share_id_of)."""


def layout_key(*parts: object) -> str:
    """A short stable name for what makes KV interchangeable (e.g. model, format, dtype, shape)."""
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def parse_record(data: bytes | memoryview, block_hash: bytes, block_bytes: int) -> memoryview | None:
    """The KV bytes of a block record (a tier file, or a frame from a peer) that is whole
    and is ``block_hash``'s: its magic, hash, length and checksum all match; else None."""
    if len(data) != HEADER.size + block_bytes:
        return None
    magic, stored_hash, length, digest = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    if magic != MAGIC or stored_hash != block_hash or length != block_bytes or checksum(payload) != digest:
        return None
    return payload


class DiskTier:
    """A PrefixTier over files in ``directory`` (see the module docstring).

    kv_cache: the pool, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    name = "disk"
    next_tier: PrefixTier | None = None
    """The last tier: nothing after it."""

    def __init__(self, kv_cache: torch.Tensor, directory: str, capacity_bytes: int, key: str) -> None:
        self.kv_cache = kv_cache
        self.events: KVEventLog | None = None
        """Where blocks entering and leaving the tier are recorded (None: nowhere)."""
        self.key = key
        """The layout key: a peer's blocks are interchangeable with these only under the same."""
        self.directory = os.path.join(directory, key)
        os.makedirs(self.directory, exist_ok=True)
        self.share_id = share_id_of(self.directory)
        """The same for every disk tier that reads these files (one folder, whichever host
        mounts it): the router's index counts their blocks as each other's."""
        block = kv_cache[:, :, 0]
        self.block_bytes = block.numel() * block.element_size()
        self.capacity_blocks = max(capacity_bytes // (self.block_bytes + HEADER.size), 0)
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._pending: dict[bytes, torch.Tensor] = {}
        """Copies waiting for the writer (guarded by _lock)."""
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        """Files this worker knows of, least recently used first (guarded by _lock)."""
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def path_of(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kv")

    # -- PrefixTier ---------------------------------------------------------------------

    def holds(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._pending:
                return True
        return os.path.exists(self.path_of(block_hash))

    def offload(self, block_id: int, block_hash: bytes) -> None:
        if self._may_keep(block_hash):
            # copy: [num_layers, 2, block_size, num_kv_heads, head_dim]
            self._queue_write(block_hash, self.kv_cache[:, :, block_id].to("cpu", copy=True))

    def offload_copy(self, block_hash: bytes, kv: torch.Tensor) -> None:
        if self._may_keep(block_hash):
            self._queue_write(block_hash, kv)

    def _may_keep(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is new here (one already kept becomes the most recently used)."""
        if self.capacity_blocks == 0:
            return False
        with self._lock:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
            return block_hash not in self._pending and block_hash not in self._lru

    def _queue_write(self, block_hash: bytes, copy: torch.Tensor) -> None:
        with self._lock:
            self._pending[block_hash] = copy
        self._queue.put(block_hash)
        if self.events is not None:
            self.events.record(BlockEventKind.STORED, block_hash, self.name)

    def load(self, block_hash: bytes, block_id: int) -> bool:
        started = time.perf_counter()
        with self._lock:
            copy = self._pending.get(block_hash)
        if copy is None:
            copy = self._read(block_hash)
            if copy is None:
                return False
        self.kv_cache[:, :, block_id].copy_(copy)
        with self._lock:
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)
        self.counters.loaded(self.block_bytes, time.perf_counter() - started)
        return True

    def block_hashes(self) -> list[bytes]:
        """Every block this tier can load now (those it wrote or loaded, and those still queued)."""
        with self._lock:
            return list(self._lru) + [h for h in self._pending if h not in self._lru]

    def flush(self) -> None:
        """Return once every offload queued so far is on disk (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)

    # -- files ----------------------------------------------------------------------------

    def block(self, block_hash: bytes) -> torch.Tensor | None:
        """``block_hash``'s block ([num_layers, 2, block_size, num_kv_heads, head_dim]), its
        file checked, for a peer that fetches it (kvtransfer/tier_peer.py); None when the tier
        cannot give it."""
        with self._lock:
            copy = self._pending.get(block_hash)
        return copy if copy is not None else self._read(block_hash)

    def block_of(self, payload: bytes | memoryview) -> torch.Tensor:
        """A block's KV bytes as a tensor of this tier's block shape and dtype
        ([num_layers, 2, block_size, num_kv_heads, head_dim])."""
        shape = self.kv_cache[:, :, 0].shape
        return torch.frombuffer(bytearray(payload), dtype=self.kv_cache.dtype).reshape(shape)

    def _read(self, block_hash: bytes) -> torch.Tensor | None:
        data = self._read_file(block_hash)
        return None if data is None else self.block_of(memoryview(data)[HEADER.size:])

    def _read_file(self, block_hash: bytes) -> bytes | None:
        """The file of ``block_hash``, checked; one that fails its check is deleted."""
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if parse_record(data, block_hash, self.block_bytes) is None:
            logger.warning("kv disk tier: %s fails its checksum: dropped, its block is recomputed", path)
            self.counters.num_corrupt_blocks += 1
            self._delete(block_hash)
            return None
        return data

    def _write_loop(self) -> None:
        while (block_hash := self._queue.get()) is not None:
            with self._lock:
                copy = self._pending[block_hash]
            started = time.perf_counter()
            try:
                self._write(block_hash, copy)
            except OSError as e:  # NOTE: a tier that cannot write only loses hits, never a request
                logger.warning("kv disk tier: could not write %s: %s", block_hash.hex(), e)
                if self.events is not None:
                    self.events.record(BlockEventKind.REMOVED, block_hash, self.name)
            finally:
                with self._lock:
                    del self._pending[block_hash]
                self.counters.offload_seconds += time.perf_counter() - started
                self._queue.task_done()

    def _write(self, block_hash: bytes, copy: torch.Tensor) -> None:
        record = record_of(block_hash, copy)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".writing-")
        with os.fdopen(fd, "wb") as f:
            f.write(record)
        os.replace(tmp, self.path_of(block_hash))
        self.counters.offloaded(len(record) - HEADER.size)
        with self._lock:
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)
            over = len(self._lru) - self.capacity_blocks
            dropped = [self._lru.popitem(last=False)[0] for _ in range(max(over, 0))]
        for old in dropped:
            self._delete(old)
            self.counters.num_dropped_blocks += 1

    def _delete(self, block_hash: bytes) -> None:
        with self._lock:
            self._lru.pop(block_hash, None)
        if self.events is not None:
            self.events.record(BlockEventKind.REMOVED, block_hash, self.name)
        try:
            os.unlink(self.path_of(block_hash))
        except FileNotFoundError:
            pass


def share_id_of(directory: str) -> str:
    """``directory``'s id: the first tier to look makes it, the others read it."""
    path = os.path.join(directory, SHARE_ID_FILE)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".writing-")
    with os.fdopen(fd, "w") as f:
        f.write(uuid.uuid4().hex)
    try:
        # NOTE: a link is made whole or not at all, and never over another: tiers starting
        # together agree, and none ever reads a half-written id.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path) as f:
        return f.read()


def record_of(block_hash: bytes, copy: torch.Tensor) -> bytes:
    """A block's record (a tier file's bytes, a peer's frame): the header (magic, hash, length,
    checksum), then its KV bytes."""
    payload = copy.contiguous().view(torch.uint8).numpy().tobytes()
    return HEADER.pack(MAGIC, block_hash, len(payload), checksum(payload)) + payload
