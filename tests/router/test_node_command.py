"""`tandem node-run`: SIGTERM to a Ray node's wrapper drains the node's workers through the
router's admin route (with the admin key) before the node's command gets the signal; the
wrapper exits with the command's status. Real processes, signals and HTTP; the router's pool
changes are recorded (recorded_changes.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from fake_backend import FakeBackend
from openai_harness import openai_serving
from recorded_changes import ADMIN_KEY, RecordedChanges

from tandem.router.auth import ADMIN_API_KEY_ENV, AUTH_TOKEN_ENV

# The node's command: says it is up, and on SIGTERM writes when it got it and exits 7.
NODE = ("import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'w').write(repr(time.time()))\n"
        "    sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(120)\n")


class TimedChanges(RecordedChanges):
    drained_at = 0.0
    """When the drain answered (time.time())."""

    async def drain_node(self, node_ip: str, timeout_s: float, replace: bool) -> list[str]:
        await asyncio.sleep(0.5)  # a drain takes a while: the node must wait for it
        self.drained_at = time.time()
        return await super().drain_node(node_ip, timeout_s, replace)


def terminated_node(router_tokenizer, changes: RecordedChanges, *args: str, stopped: Path,
                    env: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Run `tandem node-run ARGS -- NODE` against a router over ``changes``, SIGTERM it once
    the node is up -> its exit status and stderr."""
    backend = FakeBackend(router_tokenizer)
    backend.pool_changes = changes  # type: ignore[attr-defined]

    async def body() -> tuple[int, bytes]:
        async with openai_serving(backend, admin_key=ADMIN_KEY) as served:
            node = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem", "node-run", "--url", served.root, *args,
                "--", sys.executable, "-c", NODE, str(stopped),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
            assert node.stdout is not None and node.stderr is not None
            assert await asyncio.wait_for(node.stdout.readline(), 60) == b"up\n"
            node.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(node.wait(), 60), await node.stderr.read()

    return asyncio.run(body())


def test_sigterm_drains_the_nodes_workers_before_the_node_stops(router_tokenizer, tmp_path: Path):
    changes = TimedChanges()
    stopped = tmp_path / "stopped"
    code, stderr = terminated_node(router_tokenizer, changes, "--node-ip", "10.1.2.3", "--replace", "--timeout-s",
                                   "30", "--admin-api-key", ADMIN_KEY, stopped=stopped)
    assert code == 7, stderr  # the node's own status
    assert changes.calls == [("drain_node", "10.1.2.3", 30.0, True)]
    assert changes.drained_at <= float(stopped.read_text())  # drained first, then stopped
    assert b"SIGTERM: draining the workers on 10.1.2.3" in stderr


def test_a_refused_drain_still_stops_the_node(router_tokenizer, tmp_path: Path):
    """No admin key given: the router refuses (401), and the node stops all the same."""
    changes = RecordedChanges()
    env = {k: v for k, v in os.environ.items() if k not in (ADMIN_API_KEY_ENV, AUTH_TOKEN_ENV)}
    code, stderr = terminated_node(router_tokenizer, changes, "--node-ip", "10.1.2.3", stopped=tmp_path / "stopped",
                                   env=env)
    assert code == 7 and changes.calls == []
    assert b"HTTP 401" in stderr and b"the drain failed" in stderr
