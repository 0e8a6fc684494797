"""The write permission of a shared KV pool: which reservation a same-node sender may write,
and the cross-process lock that makes taking it back a fence.

The pool's file holds a grant table, one int64 per block: a reservation's token in the
entries of the blocks it may write (0: nobody may). The lock of a reservation is an
open-file-description (OFD) record lock on the table entry of its first written block,
its *slot*. A sender holds it around each layer it writes and writes only when every
block it writes still holds its token; the receiver holds it while it grants or revokes.
OFD locks are released by the kernel when their holder dies, and (unlike fcntl.lockf's
per-process locks) two descriptors of one process exclude each other too, so a sender and a
receiver in one process are fenced alike.

NOTE: the fence. Revoking takes the slot's lock, so it waits for a layer being written to
finish; a sender that takes the lock afterwards finds its token gone and writes nothing.
Once `revoke` returns, no byte lands in those blocks again (until a new grant). A writer
stopped inside a write (SIGSTOP) holds the lock as long as it is stopped: the receiver tries
`try_revoke` first and leaves a revoke that must wait to a thread of its own (revoker.py),
keeping the blocks out of its pool until then.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

logger = logging.getLogger(__name__)

# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding.
_FLOCK = struct.Struct("@hhqqi4x")
SLOW_REVOKE_S = 1.0  # a revoke that waited this long is logged: a writer was stopped inside a write

OFD_LOCKS = sys.platform == "linux" and hasattr(fcntl, "F_OFD_SETLKW") and struct.calcsize("@q") == 8
"""Whether this platform has the locks the fence needs (without them the shm path is not offered)."""


def ofd_lock(fd: int, start: int, length: int, wait: bool = True) -> bool:
    """Take an exclusive OFD lock on bytes [start, start + length) of fd's file.
    -> False when `wait` is off and someone else holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ofd_unlock(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def ofd_held(fd: int, start: int, length: int) -> bool:
    """Whether another open file description holds a lock on bytes [start, start + length) of fd's file."""
    found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return _FLOCK.unpack(found)[0] != fcntl.F_UNLCK


def granted_blocks(block_ids: Sequence[int], block_size: int, num_cached_tokens: int) -> list[int]:
    """The blocks of a reservation a sender writes (those after the receiver's cached prefix,
    whole blocks); the first is the reservation's slot."""
    return list(block_ids[num_cached_tokens // block_size:])


class GrantFence:
    """One process's handle on a pool's grant table (`table`, at byte `table_offset` of the
    file open as `fd`). The receiver grants and revokes; a sender writes inside `writing`."""

    def __init__(self, fd: int, table: np.ndarray, table_offset: int) -> None:
        self.fd = fd
        self.table = table
        self.table_offset = table_offset
        # NOTE: threads sharing one descriptor share its OFD locks: a mutex per slot makes them
        # take turns on it (one for all would let a revoke waiting on a stopped writer's slot
        # hold up the grants of every other slot).
        self._mutexes: dict[int, threading.Lock] = {}
        self._mutexes_guard = threading.Lock()
        self._tokens = itertools.count(1)  # the receiver's: unique for the pool's life

    def _mutex(self, slot: int) -> threading.Lock:
        with self._mutexes_guard:
            return self._mutexes.setdefault(slot, threading.Lock())

    @contextmanager
    def _holding(self, slot: int, wait: bool = True) -> Iterator[bool]:
        """Hold the slot's lock; -> False (holding nothing) when `wait` is off and someone has it."""
        start = self.table_offset + slot * self.table.itemsize
        mutex = self._mutex(slot)
        if not mutex.acquire(blocking=wait):
            yield False
            return
        try:
            if not ofd_lock(self.fd, start, self.table.itemsize, wait=wait):
                yield False
                return
            try:
                yield True
            finally:
                ofd_unlock(self.fd, start, self.table.itemsize)
        finally:
            mutex.release()

    def grant(self, blocks: Sequence[int]) -> int:
        """Let the holder of the returned token write `blocks` (the receiver, at reservation)."""
        token = next(self._tokens)
        with self._holding(blocks[0]):
            self.table[list(blocks)] = token
        return token

    def revoke(self, blocks: Sequence[int]) -> None:
        """Close `blocks` to their reservation's sender; returns once no write can land in them."""
        started = time.monotonic()
        with self._holding(blocks[0]):
            self.table[list(blocks)] = 0
        waited = time.monotonic() - started
        if waited >= SLOW_REVOKE_S:
            logger.warning("kv fence: revoking blocks %s waited %.1f s for a writer", blocks[:4], waited)

    def try_revoke(self, blocks: Sequence[int]) -> bool:
        """`revoke` if no write is under way in `blocks` now; -> False (nothing done) when one is."""
        with self._holding(blocks[0], wait=False) as held:
            if held:
                self.table[list(blocks)] = 0
        return held

    @contextmanager
    def writing(self, slot: int, token: int, blocks: Sequence[int] | np.ndarray) -> Iterator[bool]:
        """Hold the slot's lock; -> whether `blocks` are all still granted to `token` (write
        them only then, inside the with block)."""
        with self._holding(slot):
            yield bool(np.all(self.table[np.asarray(blocks, dtype=np.int64)] == token))
