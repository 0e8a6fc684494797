"""A `tandem serve` of its own for a measured run: started as a client would start it (its
own process, its own local Ray), read for its address, stopped with Ctrl-C's signal and
waited for, so that nothing of it is left to steal cycles from the next run."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SERVING = re.compile(r"tandem: serving .* on (\S+):(\d+) \(gRPC")
"""The line `tandem serve` prints once it serves (router/serve_command.py)."""
START_TIMEOUT_S, STOP_TIMEOUT_S = 300.0, 60.0


class ServedProcess:
    """``tandem serve <args>`` on free ports, gRPC only (no HTTP API, /metrics on a free port)."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None) -> None:
        """env: environment variables set for it (and so for its Ray and workers) on top of this process's."""
        self.serve_args = serve_args
        self.env = env or {}
        self.log = Path(tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.target: str | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Start it and wait until it serves -> its gRPC address (HOST:PORT)."""
        command = [sys.executable, "-m", "tandem", "serve", "--port", "0", "--metrics-port", "0", "--http-port", "-1",
                   "--disable-log-requests", *self.serve_args]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = SERVING.search(self.log.read_text(errors="replace"))
            if match:
                self.target = f"{match.group(1)}:{match.group(2)}"
                return self.target
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tandem serve {' '.join(self.serve_args)} did not start; its log: {self.log}")

    def processes(self) -> dict[int, str]:
        """pid -> what it is, for the server and every process under it (Ray's daemons, the workers)."""
        assert self.process is not None
        root = psutil.Process(self.process.pid)
        out = {root.pid: f"router (nice {root.nice()})"}
        for child in root.children(recursive=True):
            try:
                name = child.cmdline()[0] if child.cmdline() else child.name()
                out[child.pid] = f"{Path(name.split()[0]).name[:24]} (nice {child.nice()})"
            except psutil.Error:
                continue
        return out

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop it as Ctrl-C does; kill what is left after ``timeout``; wait for every process."""
        if self.process is None:
            return
        tree = [psutil.Process(self.process.pid)]
        try:
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            pass
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(tree, timeout=timeout)
        for p in alive:
            logger.warning("killing %d (%s), still running %.0f s after the server was stopped", p.pid,
                           p.name(), timeout)
            p.kill()
        psutil.wait_procs(alive, timeout=10)
        self.process = None
        if self.target is not None:  # it served: its log is kept only when it failed to start
            self.log.unlink(missing_ok=True)
