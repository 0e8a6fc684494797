"""Defect 3 with a peer process KILLED mid-transfer (SIGKILL), on NCCL's rules (the fake
backend): the survivor's send to it and its receive from it (mid-layer: K came, V never
will) each end with PeerLost within the transfer timeout; the fake watchdog does not end the
survivor; the survivor's other pair still works (nccl_killed_peer.py, two processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fake_nccl

HERE = Path(__file__).parent
TRANSFER_TIMEOUT_S = 2.0  # nccl_killed_peer.TIMEOUT_S


class Peer(subprocess.Popen[str]):
    """nccl_killed_peer.py in a process of its own: JSON lines in and out, stderr to a file."""

    stderr_path: Path


def start(role: str, stderr: Path) -> Peer:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    # (stderr to a file: torch logs every failed store operation against the dead peer, and
    # an unread pipe would fill and block the survivor)
    p = Peer([sys.executable, str(HERE / "nccl_killed_peer.py"), role], stdin=subprocess.PIPE,
             stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, env=env)
    p.stderr_path = stderr
    return p


def line(p: Peer) -> dict:
    """The next JSON line `p` prints (its stderr's end when it prints none)."""
    assert p.stdout is not None
    out = p.stdout.readline()
    assert out, f"exited {p.wait(5)}: {p.stderr_path.read_text()[-3000:]}"
    return json.loads(out)


def tell(p: Peer, **fields) -> None:
    assert p.stdin is not None
    p.stdin.write(json.dumps(fields) + "\n")
    p.stdin.flush()


def test_peer_killed_mid_transfer_fails_only_its_pairs(tmp_path):
    victim, survivor = start("victim", tmp_path / "victim.err"), start("survivor", tmp_path / "survivor.err")
    try:
        tell(survivor, **line(victim))  # the victim's offer
        tell(victim, **line(survivor))  # the survivor's offer
        assert line(victim) == {"ready": True} and line(survivor) == {"sent": True}
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        tell(survivor, killed=True)
        report = line(survivor)
        survivor.wait(30)
    finally:
        for p in (victim, survivor):
            if p.poll() is None:
                p.kill()
    assert survivor.returncode != fake_nccl.WATCHDOG_EXIT, f"the watchdog ended the survivor: {report}"
    assert survivor.returncode == 0, (tmp_path / "survivor.err").read_text()[-3000:]
    assert report["send"].startswith("PeerLost: send to rank 1 did not complete within 1.0 s"), report
    assert report["recv"].startswith("PeerLost: recv from rank 0 did not complete within 1.0 s"), report
    assert report["send_s"] < TRANSFER_TIMEOUT_S and report["recv_s"] < TRANSFER_TIMEOUT_S, report
    assert report["live"] == 2, "the survivor's other pair stopped working"
    # the live pair's two sides; both of the dead peer's pairs aborted on the survivor's side
    assert report["alive"] and report["live_communicators"] == 2, report
