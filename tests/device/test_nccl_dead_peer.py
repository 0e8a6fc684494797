"""Defect 3: a hung KV peer on NCCL. NCCL's wait() neither blocks nor raises, and its
watchdog ends the process once a work outlives the group's timeout: the sender must see the
send fail within its own deadline, abort that pair first (so the watchdog spares the
process), and keep its other pairs (nccl_survivor.py, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fake_nccl

HERE = Path(__file__).parent


def test_hung_peer_fails_the_send_and_spares_the_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    run = subprocess.run([sys.executable, str(HERE / "nccl_survivor.py")], capture_output=True, text=True,
                         timeout=60, env=env)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode != fake_nccl.WATCHDOG_EXIT, \
        f"the watchdog ended the survivor:\n{run.stdout}{run.stderr[-2000:]}"
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = lines
    assert first["hung"].startswith("PeerLost: send to rank 1 did not complete"), first
    assert first["hung_s"] < 2.0, "not within the transfer timeout (2 s)"
    assert first["live"] == 2, "the other pair stopped working"
    assert last == {"alive": True, "live_communicators": 3}, last  # the hung pair's sender side aborted
