"""The fake NCCL backend's watchdog (fake_nccl.py): one thread per process, as torch's NCCL
watchdog, that ends the process when a communicator's work outlives its timeout."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class Watchdog:
    """Watches `groups()` (each with `overdue(now)` -> a work or None, and `timeout`)."""

    def __init__(self, groups: Callable[[], list[Any]], name: str, exit_status: int) -> None:
        self._groups, self._name, self._exit = groups, name, exit_status
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Start the thread (once per process)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            for group in self._groups():
                work = group.overdue(now)
                if work is not None:
                    print(f"[{self._name}] Watchdog caught collective operation timeout: {work.op} {work.key} ran for "
                          f"{now - work.started:.1f} s (timeout {group.timeout.total_seconds():.1f} s): "
                          "terminating the process", file=sys.stderr, flush=True)
                    os._exit(self._exit)  # NOTE: as torch's: no cleanup, no exception to catch
            time.sleep(0.05)
