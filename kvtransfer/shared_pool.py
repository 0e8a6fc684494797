"""A KV pool in shared memory: a file under /dev/shm that a decode worker owns and the prefill
workers of its node map, so that each layer's rows are copied once, from the prefill pool
straight into the reserved blocks, while ZMQ carries only the headers.

The file holds the pool ([layers, 2, blocks, block_size, kv_heads, head_dim], from byte 0),
then, from the next page, the grant table of the fence (fence.py): one int64 per block.
The owner removes the file when it closes the pool or exits; a small watcher process
removes it when the owner is killed (Ray stops workers with SIGKILL). The owner also holds
an OFD lock on byte 0 for as long as its process has the file open or mapped: a file whose
lock nobody holds is a dead worker's, removed by the next pool made on the host, and
unmapped by the senders that still map it.

One class per mechanism: HostSharedPool and MappedPool share host memory through a file.
A pool in GPU memory would be shared by CUDA IPC handles, in classes of their own behind
the same handshake; that is not built, and a sender whose own pool is not in host memory
never takes this path (KVSender).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import subprocess
import sys
import uuid
import weakref

import numpy as np
import torch

from tandem.config_names import DTYPE_BYTES
from tandem.kvtransfer.fence import OFD_LOCKS, GrantFence, ofd_held, ofd_lock
from tandem.kvtransfer.payload import TORCH_DTYPES, layout_for
from tandem.kvtransfer.protocol import KVLayout

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME = re.compile(r"tandem-kv-[0-9a-f]{32}")
"""A pool file's name (no directory: a name from the wire never leaves SHM_DIR)."""
_OWNER_LOCK = (0, 1)  # (start, length): the owner's liveness lock
# Run beside the owner: once the owner's end of its stdin is closed (it exited, however), remove the file.
_WATCHER = """import os, sys
sys.stdin.buffer.read()
try:
    os.unlink(sys.argv[1])
except FileNotFoundError:
    pass
"""


def file_sizes(layout: KVLayout) -> tuple[int, int, int]:
    """-> (pool bytes, grant table offset, file bytes) of a pool file for `layout`."""
    pool = (layout.num_layers * 2 * layout.num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
            * DTYPE_BYTES[layout.dtype])
    table = -(-pool // mmap.PAGESIZE) * mmap.PAGESIZE
    return pool, table, table + 8 * layout.num_blocks


class _PoolFile:
    """A pool file mapped into this process: its pool tensor and its grant fence."""

    def __init__(self, name: str, fd: int, layout: KVLayout, populate: bool) -> None:
        """Takes `fd` (closed by `close`). populate: fault every page in now (the owner, as
        a zeroed private pool would), rather than at first touch."""
        pool_bytes, table_offset, file_bytes = file_sizes(layout)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._map = mmap.mmap(fd, file_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.name = name
        self.fd = fd
        self.layout = layout
        self.num_bytes = file_bytes
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # NOTE: the tensor keeps the mapping alive (the mmap object is its buffer) after close().
        self.kv_cache = torch.frombuffer(self._map, dtype=dtype, count=pool_bytes // dtype.itemsize).view(shape)
        table = np.frombuffer(self._map, dtype=np.int64, count=layout.num_blocks, offset=table_offset)
        self.fence = GrantFence(fd, table, table_offset)
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        """Let go of the file (at once, or when this object goes); the mapping lives as long
        as its tensors."""
        self._closer()


class HostSharedPool(_PoolFile):
    """The owner's side: the receiving worker's KV pool itself, in a file others can map."""

    def __init__(self, name: str, path: str, fd: int, layout: KVLayout) -> None:
        # NOTE: a session of its own, so that a Ctrl-C to the owner's process group spares it.
        watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, path], stdin=subprocess.PIPE,
                                   start_new_session=True)
        try:
            super().__init__(name, fd, layout, populate=True)
        except BaseException:
            _release(path, watcher)
            raise
        self.path = path
        # Normal exits remove the file too (here), a killed owner's goes with the watcher.
        self._remover = weakref.finalize(self, _release, path, watcher)

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, directory: str = SHM_DIR) -> HostSharedPool | None:
        """A zeroed pool of `shape` and `dtype` in a new file of `directory`, or None (logged)
        when it cannot be made there: no room (Docker's default /dev/shm is 64 MiB), no
        such directory, no OFD locks on this platform."""
        layout = layout_for(shape, dtype)
        file_bytes = file_sizes(layout)[2]
        if not OFD_LOCKS:
            logger.warning("kv pool: no OFD locks on this platform: private pool, no shared-memory transfers")
            return None
        try:
            sweep_stale(directory)
            stat = os.statvfs(directory)
        except OSError as e:
            logger.warning("kv pool: %s is not usable (%s): private pool, no shared-memory transfers", directory, e)
            return None
        if stat.f_bavail * stat.f_frsize < file_bytes:
            logger.warning("kv pool: %s has %.0f MiB free, the pool needs %.0f MiB: private pool, no shared-memory "
                           "transfers (give it more, e.g. docker --shm-size)", directory,
                           stat.f_bavail * stat.f_frsize / 2**20, file_bytes / 2**20)
            return None
        name = f"tandem-kv-{uuid.uuid4().hex}"
        path, creating = os.path.join(directory, name), os.path.join(directory, f".{name}.creating")
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # NOTE: locked before it has the name a sweep looks for, so no sweep takes it for a dead one's.
            ofd_lock(fd, *_OWNER_LOCK)
            os.rename(creating, path)
            # Allocated now, not at first touch: a full /dev/shm fails here, not with SIGBUS mid-write.
            os.posix_fallocate(fd, 0, file_bytes)
            pool = cls(name, path, fd, layout)
        except Exception as e:  # whatever it is, the worker goes on with a private pool
            os.close(fd)
            for leftover in (creating, path):
                _remove(leftover)
            logger.warning("kv pool: cannot make %s (%s): private pool, no shared-memory transfers", path, e)
            return None
        logger.info("kv pool in shared memory: %s (%.0f MiB)", path, file_bytes / 2**20)
        return pool

    def close(self) -> None:
        """Remove the file; senders that mapped it keep their mapping (writing to nobody)."""
        self._remover()
        super().close()


class MappedPool(_PoolFile):
    """A sender's side: another worker's pool, mapped to write into."""

    def owner_alive(self) -> bool:
        """Whether the pool's owner still has it (a dead one's pool is written for nobody)."""
        return ofd_held(self.fd, *_OWNER_LOCK)

    @classmethod
    def open(cls, name: str, directory: str = SHM_DIR) -> int:
        """Open the pool file `name` (before the handshake); -> its descriptor, for `MappedPool`.
        Raises OSError or ValueError when it cannot be opened here."""
        if not OFD_LOCKS:
            raise ValueError("no OFD locks on this platform")
        if not NAME.fullmatch(name):
            raise ValueError(f"not a KV pool name: {name!r}")
        return os.open(os.path.join(directory, name), os.O_RDWR)

    def __init__(self, name: str, fd: int, layout: KVLayout) -> None:
        """Map the file open as `fd` as a pool of `layout` (the receiver's, from the handshake).
        Takes `fd`; ValueError when the file's size is not the layout's."""
        size = os.fstat(fd).st_size
        if size != file_sizes(layout)[2]:
            raise ValueError(f"{name} holds {size} bytes, a pool of {layout} needs {file_sizes(layout)[2]}")
        super().__init__(name, fd, layout, populate=False)


def sweep_stale(directory: str) -> None:
    """Remove the pool files of owners that are gone (nobody holds their liveness lock)."""
    for entry in os.scandir(directory):
        if not NAME.fullmatch(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            if not ofd_held(fd, *_OWNER_LOCK):
                logger.info("kv pool: removing %s, whose owner is gone", entry.path)
                _remove(entry.path)
        finally:
            os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _release(path: str, watcher: subprocess.Popen) -> None:
    _remove(path)
    watcher.stdin.close()  # its cue: it finds the file gone, and exits
    watcher.wait()
