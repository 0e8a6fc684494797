"""The engine loop's heartbeat as a file, for a liveness probe outside the worker's process.

Each worker process whose environment names a directory (TANDEM_HEARTBEAT_DIR) keeps a file
`<instance>.<pid>` there and touches it as its engine loop goes round (at most once a
second). `tandem heartbeat-check DIR` (a Kubernetes exec probe on every worker pod) fails
when a live worker's file is older than its bound: an engine loop stuck in a step, which no
process exit reveals. Files of processes that are gone are removed: Ray restarts those.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HEARTBEAT_DIR_ENV = "TANDEM_HEARTBEAT_DIR"
BEAT_EVERY_S = 1.0


class HeartbeatFile:
    def __init__(self, directory: str | os.PathLike, instance: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{instance}.{os.getpid()}"
        self.path.touch()
        self._last_beat = time.monotonic()

    @classmethod
    def from_env(cls, instance: str) -> HeartbeatFile | None:
        directory = os.environ.get(HEARTBEAT_DIR_ENV, "")
        return cls(directory, instance) if directory else None

    def beat(self, now: float) -> None:
        """The loop went round at `now` (time.monotonic()); the file says so within a second."""
        if now - self._last_beat >= BEAT_EVERY_S:
            self._last_beat = now
            self.path.touch()


def stale_heartbeats(directory: str | os.PathLike, max_age_s: float) -> dict[str, float]:
    """-> {file name: seconds since its last beat} of live workers' files older than max_age_s.
    A file whose process is gone is removed."""
    stale = {}
    now = time.time()
    for path in Path(directory).glob("*.*"):
        try:
            pid = int(path.suffix[1:])
        except ValueError:
            continue
        if not _alive(pid):
            path.unlink(missing_ok=True)
            continue
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > max_age_s:
            stale[path.name] = age
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
