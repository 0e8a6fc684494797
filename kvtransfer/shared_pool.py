"""A KV pool in shared memory: a file in /dev/shm that a decode worker owns and the prefill
workers of its node map, so that each layer's rows are copied once, from the prefill pool
straight into the reserved blocks, while ZMQ carries only the headers.

The file holds the pool ([layers, 2, blocks, block_size, kv_heads, head_dim], from byte 0),
then, from the next page, a tag (16 random bytes) and the grant table of the fence
(fence.py): one int64 per block. It is unlinked as soon as it is made: its memory lives as
long as a process has it open or mapped, so no file outlives its worker, however the worker
ends (Ray stops workers with SIGKILL). Others open it by its owner's descriptor,
/proc/<pid>/fd/<fd>, and check the tag (a reused pid names another file). The owner holds an
OFD lock on byte 0 for as long as it has the file: a sender that finds nobody holding it
lets go of its mapping, so a dead worker's pool is freed.

A pool in GPU memory is shared by CUDA IPC instead (cuda_ipc.py), but fenced the same way:
its owner makes a file of the same kind with no pool bytes in it (FenceFile: the tag and
the grant table from byte 0), which a sender on its host opens by name like a pool.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import uuid
import weakref
from typing import Any, Self, TypeVar

import numpy as np
import torch

from tandem.config.names import DTYPE_BYTES
from tandem.kvtransfer.fence import OFD_LOCKS, GrantFence, ofd_held, ofd_lock
from tandem.kvtransfer.payload import TORCH_DTYPES, layout_for
from tandem.kvtransfer.protocol import KVLayout

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound="_PoolFile")

SHM_DIR = "/dev/shm"
NAME = re.compile(r"tandem-kv-(?P<pid>\d+)-(?P<fd>\d+)-(?P<tag>[0-9a-f]{32})")
"""A pool's name: its owner's pid, the descriptor it holds the file open by, and the tag."""
_OWNER_LOCK = (0, 1)  # (start, length): the owner's liveness lock
_TAG_BYTES = 16
_TABLE_AFTER_TAG = 64  # the grant table starts a cache line after the tag


def pool_bytes(layout: KVLayout) -> int:
    """Bytes of a pool of `layout`."""
    return (layout.num_layers * 2 * layout.num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
            * DTYPE_BYTES[layout.dtype])


def file_sizes(layout: KVLayout, pool_in_file: bool = True) -> tuple[int, int, int]:
    """-> (pool bytes, tag offset, file bytes) of a pool file for `layout` (the grant table
    follows the tag); pool_in_file off: a FenceFile's, which holds no pool bytes."""
    pool = pool_bytes(layout) if pool_in_file else 0
    tag = -(-pool // mmap.PAGESIZE) * mmap.PAGESIZE
    return pool, tag, tag + _TABLE_AFTER_TAG + 8 * layout.num_blocks


class _PoolFile:
    """A pool file mapped into this process: its pool tensor (when it holds the pool), its
    tag and its grant fence."""

    POOL_IN_FILE = True
    """Whether the file holds the pool's bytes (False: the pool is on a GPU, cuda_ipc.py)."""

    def __init__(self, name: str, fd: int, layout: KVLayout, populate: bool) -> None:
        """Takes `fd` (closed by `close`). populate: fault every page in now (the owner, as
        a zeroed private pool would), rather than at first touch."""
        num_pool_bytes, tag_offset, file_bytes = file_sizes(layout, self.POOL_IN_FILE)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._map = mmap.mmap(fd, file_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.name = name
        self.fd = fd
        self.layout = layout
        self.num_bytes = file_bytes
        if self.POOL_IN_FILE:
            dtype = TORCH_DTYPES[layout.dtype]
            shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
            # NOTE: the tensor keeps the mapping alive (the mmap object is its buffer) after close().
            self.kv_cache = torch.frombuffer(self._map, dtype=dtype, count=num_pool_bytes // dtype.itemsize).view(shape)
        table_offset = tag_offset + _TABLE_AFTER_TAG
        table = np.frombuffer(self._map, dtype=np.int64, count=layout.num_blocks, offset=table_offset)
        self.fence = GrantFence(fd, table, table_offset)
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        """Let go of the file (at once, or when this object goes); the mapping lives as long
        as its tensors."""
        self._closer()


class HostSharedPool(_PoolFile):
    """The owner's side: the receiving worker's KV pool itself, in a file others can map."""

    path = "shm"
    """The in-place path it serves (path_choice.PATHS)."""
    device = ""
    """Its CUDA device (none: host memory)."""
    kv_cache: torch.Tensor

    def export(self) -> dict[str, Any]:
        """The HELLO_OK fields a sender needs besides the pool's name: none (it maps the file)."""
        return {}

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, directory: str = SHM_DIR) -> Self | None:
        """A zeroed pool of `shape` and `dtype` in an unlinked file of `directory`, or None
        (logged) when it cannot be made there: no room (Docker's default /dev/shm is 64 MiB),
        no such directory, no OFD locks on this platform."""
        return _create(cls, layout_for(shape, dtype), directory)


def _create(cls: type[_F], layout: KVLayout, directory: str) -> _F | None:
    """A new unlinked file of `cls`'s kind for `layout` in `directory`, its owner's lock
    taken, or None (logged)."""
    file_bytes = file_sizes(layout, cls.POOL_IN_FILE)[2]
    if not OFD_LOCKS:
        logger.warning("kv pool: no OFD locks on this platform: private pool, no shared-memory transfers")
        return None
    try:
        free = os.statvfs(directory)
    except OSError as e:
        logger.warning("kv pool: %s is not usable (%s): private pool, no shared-memory transfers", directory, e)
        return None
    if free.f_bavail * free.f_frsize < file_bytes:
        logger.warning("kv pool: %s has %.0f MiB free, the pool needs %.0f MiB: private pool, no shared-memory "
                       "transfers (give it more, e.g. docker --shm-size)", directory,
                       free.f_bavail * free.f_frsize / 2**20, file_bytes / 2**20)
        return None
    path = os.path.join(directory, f".tandem-kv-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        logger.warning("kv pool: cannot make a file in %s (%s): private pool, no shared-memory transfers",
                       directory, e)
        return None
    tag = uuid.uuid4().hex
    try:
        os.unlink(path)  # NOTE: at once: nothing is left behind, whatever ends this process
        ofd_lock(fd, *_OWNER_LOCK)
        # Allocated now, not at first touch: a full /dev/shm fails here, not with SIGBUS mid-write.
        os.posix_fallocate(fd, 0, file_bytes)
        os.pwrite(fd, bytes.fromhex(tag), file_sizes(layout, cls.POOL_IN_FILE)[1])
        pool = cls(f"tandem-kv-{os.getpid()}-{fd}-{tag}", fd, layout, populate=True)
    except Exception as e:  # whatever it is, the worker goes on with a private pool
        os.close(fd)
        logger.warning("kv pool: cannot make it in %s (%s): private pool, no shared-memory transfers", directory, e)
        return None
    logger.info("kv %s in shared memory (%s): %s, %.0f MiB", "pool" if cls.POOL_IN_FILE else "grant table", directory,
                pool.name, file_bytes / 2**20)
    return pool


class FenceFile(_PoolFile):
    """The owner's side for a pool on a GPU: the grant table alone, in a file of the pool
    kind (the pool's bytes go by CUDA IPC, cuda_ipc.py)."""

    POOL_IN_FILE = False

    @classmethod
    def create(cls, layout: KVLayout, directory: str = SHM_DIR) -> Self | None:
        """A zeroed grant table for a pool of `layout`, or None (logged) as HostSharedPool.create."""
        return _create(cls, layout, directory)


class _MappedFile(_PoolFile):
    """A sender's side of another worker's file."""

    @staticmethod
    def open(name: str) -> int:
        """Open the pool `name` through its owner's descriptor (before the handshake); -> a
        descriptor of its own, for `MappedPool`. OSError or ValueError when it cannot be
        opened here (another host or pid namespace, the owner gone, no OFD locks)."""
        if not OFD_LOCKS:
            raise ValueError("no OFD locks on this platform")
        match = NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"not a KV pool name: {name!r}")
        fd = os.open(f"/proc/{match['pid']}/fd/{match['fd']}", os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a reused pid's descriptor: not a pool at all
            os.close(fd)
            raise ValueError(f"{name} is not a file")
        return fd

    def __init__(self, name: str, fd: int, layout: KVLayout) -> None:
        """Map the file open as `fd` as a pool of `layout` (the receiver's, from the
        handshake); takes `fd` once mapped. ValueError (`fd` left to the caller) when the
        file's size is not the layout's, or its tag not the name's."""
        _, tag_offset, file_bytes = file_sizes(layout, self.POOL_IN_FILE)
        size = os.fstat(fd).st_size
        if size != file_bytes:
            raise ValueError(f"{name} holds {size} bytes, a pool of {layout} needs {file_bytes}")
        match = NAME.fullmatch(name)
        assert match is not None, f"not a KV pool name: {name!r}"  # (open_fd took the fd by this name)
        if os.pread(fd, _TAG_BYTES, tag_offset).hex() != match["tag"]:
            raise ValueError(f"{name}: the file there is another one (its tag differs)")
        super().__init__(name, fd, layout, populate=False)

    def owner_alive(self) -> bool:
        """Whether the pool's owner still has it (a dead one's pool is written for nobody)."""
        return ofd_held(self.fd, *_OWNER_LOCK)


class MappedPool(_MappedFile):
    """A sender's side: another worker's pool, mapped to write into (an in_place.InPlaceTarget)."""

    path = "shm"
    kv_cache: torch.Tensor


class MappedFence(_MappedFile):
    """A sender's side of a FenceFile: the grant table of a GPU pool it writes by CUDA IPC."""

    POOL_IN_FILE = False
