"""`tandem node-run -- ray start ... --block`: a Ray node's command, run so that SIGTERM to it
drains the node's workers first. On SIGTERM (or SIGINT) it asks the router to drain every
worker on this node (`tandem drain --node-ip`, with `--replace` if given) and waits for that,
then passes the signal to the command and exits with its status. What Kubernetes' preStop hook
does for the Helm chart, for nodes run by docker-compose, systemd or a shell."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
from typing import Any

from tandem.router import admin_command
from tandem.router.pool_changes import DEFAULT_DRAIN_TIMEOUT_S

logger = logging.getLogger(__name__)


def add_command(commands: Any) -> None:
    p = commands.add_parser("node-run", help="run a Ray node's command; on SIGTERM, drain the node's workers "
                                             "through the router first, then stop the command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the node's command, after --, e.g. -- ray start "
                                                             "--address=HEAD:6379 --block")
    p.add_argument("--node-ip", default=None,
                   help="this node's address as Ray knows it (default: ray.util.get_node_ip_address())")
    p.add_argument("--replace", action="store_true", help="start a replacement for each worker first")
    p.add_argument("--timeout-s", "--drain-timeout-s", dest="timeout_s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"as tandem drain's --timeout-s (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    admin_command.connection_args(p)
    p.set_defaults(func=node_run)


def node_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.stderr.write("tandem node-run: give the node's command after --\n")
        return 2
    node_ip = args.node_ip or _ray_node_ip()
    stopping = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        caught.append(signum)
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    child = subprocess.Popen(command)
    while child.poll() is None and not stopping.wait(0.2):
        pass
    if caught and child.poll() is None:
        sys.stderr.write(f"tandem node-run: {signal.Signals(caught[0]).name}: draining the workers on {node_ip}\n")
        drain = argparse.Namespace(**{**vars(args), "worker": None, "node_ip": node_ip})
        if admin_command.drain(drain) != 0:  # (the router says why on stderr; the node stops all the same)
            sys.stderr.write("tandem node-run: the drain failed: their streams move as for a dead worker\n")
        child.send_signal(caught[0])
    return child.wait()


def _ray_node_ip() -> str:
    import ray.util  # (only here: the other admin commands run where Ray need not be)

    return ray.util.get_node_ip_address()
