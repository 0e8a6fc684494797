"""Host shared memory, in place: both pools in host memory on one node; the receiver's pool
is a file in /dev/shm (shared_pool.py), which the sender maps and writes (`auto` only)."""

from __future__ import annotations

import os
from typing import Any

from tandem.kvtransfer.connectors.in_place_paths import InPlaceConnector
from tandem.kvtransfer.protocol import KVLayout
from tandem.kvtransfer.shared_pool import MappedPool


class SharedMemoryConnector(InPlaceConnector):
    def open_target(self, name: str, fd: int, layout: KVLayout, reply: dict[str, Any]) -> MappedPool:
        try:
            return MappedPool(name, fd, layout)
        except BaseException:
            os.close(fd)
            raise
