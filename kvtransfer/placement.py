"""Which node a process runs on: a sender writes a receiver's pool in place only when both
name the same node (and it can map the pool)."""

from __future__ import annotations

import functools
import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def host_identity() -> str:
    """This host as long as it stays up: its hostname and the kernel's boot id (a host
    renamed, or rebooted, is another one). Under Ray, workers use Ray's node id instead, so
    that two Ray nodes on one machine (each its own /dev/shm, in containers) differ."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the hostname alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"
