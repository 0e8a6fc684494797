"""`tandem drain`, `tandem scale` and `tandem restart`: a serving cluster's workers changed
through its router's admin routes (router/openai/admin_routes.py), over HTTP with the admin key."""

from __future__ import annotations

import argparse
import json
import logging
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any

from tandem.router.auth import ADMIN_API_KEY_ENV, AUTH_TOKEN_ENV, admin_key_from_env
from tandem.router.pool_changes import DEFAULT_DRAIN_TIMEOUT_S

logger = logging.getLogger(__name__)


def add_commands(commands: Any) -> None:
    """Register drain, scale, restart and node-run on the CLI's subcommands."""
    from tandem.router import node_command  # (it builds on this module)
    p = commands.add_parser("drain", help="take a worker (or every worker of a node) out of a serving cluster "
                                          "without failing a request")
    p.add_argument("worker", nargs="?", help="the worker's name (GET /admin/workers lists them, e.g. decode-1)")
    p.add_argument("--node-ip", default=None, help="instead: every worker on the Ray node at this address "
                                                   "(a Kubernetes preStop hook gives its pod's IP)")
    p.add_argument("--replace", action="store_true",
                   help="start a replacement in the same pool first, so the pool keeps its size")
    p.add_argument("--timeout-s", "--drain-timeout-s", dest="timeout_s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="how long its requests may take to finish before the rest move to other workers "
                        f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    connection_args(p)
    p.set_defaults(func=drain)

    p = commands.add_parser("restart", help="a rolling restart: each worker replaced in turn (a new one started, "
                                            "then the old one drained)")
    p.add_argument("workers", nargs="*", help="the workers to restart (default: every worker)")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"as tandem drain's --timeout-s, for each worker (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    connection_args(p)
    p.set_defaults(func=restart)

    p = commands.add_parser("scale", help="bring a serving cluster's pools to these sizes (added workers join once "
                                          "loaded; removed ones are drained)")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}", type=int, default=None, metavar="N", help=f"{pool} workers wanted")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"as tandem drain's --timeout-s, for each worker removed (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    connection_args(p)
    p.set_defaults(func=scale)

    node_command.add_command(commands)


def connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP API (default %(default)s)")
    p.add_argument("--admin-api-key", default=None,
                   help=f"the router's admin key (default: ${ADMIN_API_KEY_ENV}, else ${AUTH_TOKEN_ENV})")
    p.add_argument("--tls-ca", default=None, help="an https --url's CA certificate (PEM; default: the system's)")


def drain(args: argparse.Namespace) -> int:
    if (args.worker is None) == (args.node_ip is None):
        sys.stderr.write("tandem drain: give a worker's name or --node-ip, not both\n")
        return 2
    where = {"worker": args.worker} if args.node_ip is None else {"node_ip": args.node_ip}
    return _post(args, "/admin/drain", {**where, "replace": args.replace, "timeout_s": args.timeout_s})


def restart(args: argparse.Namespace) -> int:
    return _post(args, "/admin/restart", {**({"workers": args.workers} if args.workers else {}),
                                          "drain_timeout_s": args.drain_timeout_s})


def scale(args: argparse.Namespace) -> int:
    sizes = {pool: getattr(args, pool) for pool in ("prefill", "decode", "colocated") if getattr(args, pool)}
    return _post(args, "/admin/scale", {**sizes, "drain_timeout_s": args.drain_timeout_s})


def _post(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    """POST body; the answer to stdout as JSON (exit 0), or the router's error to stderr (exit 1)."""
    key = admin_key_from_env(args.admin_api_key)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(args.url.rstrip("/") + path, json.dumps(body).encode(), headers)
    try:
        # (a drain waits for its requests: no timeout of our own beyond theirs)
        context = None if args.tls_ca is None else ssl.create_default_context(cafile=args.tls_ca)
        with urllib.request.urlopen(request, context=context) as response:
            sys.stdout.write(json.dumps(json.load(response), indent=2) + "\n")
        return 0
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        sys.stderr.write(f"{path}: HTTP {e.code}: {message}\n")
    except OSError as e:
        sys.stderr.write(f"{path}: cannot reach the router at {args.url}: {e}\n")
    return 1
