"""The engine loop's heartbeat file and `tandem heartbeat-check`, the worker pods' liveness probe."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, cast

from tandem.cli import main
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.heartbeat_file import BEAT_EVERY_S, HeartbeatFile, stale_heartbeats

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine


class StuckEngine:
    """An engine whose step blocks until released, as a step stuck in a collective would."""

    def __init__(self) -> None:
        self.has_unfinished = False
        self.release = threading.Event()

    def step(self) -> list:
        self.release.wait()
        self.has_unfinished = False
        return []


def age(path) -> float:
    return time.time() - path.stat().st_mtime


def test_the_file_goes_stale_while_a_step_is_stuck_and_fresh_again_after(tmp_path):
    engine = StuckEngine()
    loop = EngineLoop(cast("LLMEngine", engine))  # a fake with what the loop calls
    loop.heartbeat_file = HeartbeatFile(tmp_path, "decode-0")
    path = loop.heartbeat_file.path
    assert path.name == f"decode-0.{os.getpid()}"
    try:
        os.utime(path, (time.time() - 100, time.time() - 100))
        time.sleep(BEAT_EVERY_S + 0.5)  # idle, the loop goes round and beats
        assert age(path) < BEAT_EVERY_S + 0.5 and stale_heartbeats(tmp_path, 5) == {}
        engine.has_unfinished = True  # the next round steps, and sticks
        time.sleep(BEAT_EVERY_S + 0.5)
        stuck_at = path.stat().st_mtime
        time.sleep(2.0)
        assert path.stat().st_mtime == stuck_at
        assert set(stale_heartbeats(tmp_path, 1.5)) == {path.name}
        assert main(["heartbeat-check", str(tmp_path), "--max-age", "1.5"]) == 1
        engine.release.set()
        time.sleep(BEAT_EVERY_S + 0.5)
        assert stale_heartbeats(tmp_path, 1.5) == {}
        assert main(["heartbeat-check", str(tmp_path), "--max-age", "1.5"]) == 0
    finally:
        engine.release.set()
        loop.stop()


def test_a_gone_process_file_is_removed_not_reported(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"prefill-0.{int(gone.stdout)}"
    dead.touch()
    live = tmp_path / f"decode-0.{os.getpid()}"
    live.touch()
    for path in (dead, live):
        os.utime(path, (time.time() - 600, time.time() - 600))
    assert set(stale_heartbeats(tmp_path, 180)) == {live.name}
    assert not dead.exists()
    assert main(["heartbeat-check", str(tmp_path)]) == 1
    live.touch()
    assert main(["heartbeat-check", str(tmp_path)]) == 0
