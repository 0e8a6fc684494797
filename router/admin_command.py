"""`tandem drain` and `tandem scale`: a serving cluster's workers changed through its router's
admin routes (router/openai/admin_routes.py), over HTTP with the API key."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from tandem.router.pool_changes import DEFAULT_DRAIN_TIMEOUT_S

logger = logging.getLogger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"


def add_commands(commands: Any) -> None:
    """Register drain and scale on the CLI's subcommands."""
    p = commands.add_parser("drain", help="take a worker out of a serving cluster without failing a request")
    p.add_argument("worker", help="the worker's name (GET /admin/workers lists them, e.g. decode-1)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="how long its requests may take to finish before the rest move to other workers "
                        f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    _connection_args(p)
    p.set_defaults(func=drain)

    p = commands.add_parser("scale", help="bring a serving cluster's pools to these sizes (added workers join once "
                                          "loaded; removed ones are drained)")
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{pool}", type=int, default=None, metavar="N", help=f"{pool} workers wanted")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help=f"as tandem drain's --timeout-s, for each worker removed (default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    _connection_args(p)
    p.set_defaults(func=scale)


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP API (default %(default)s)")
    p.add_argument("--api-key", default=None, help=f"the router's API key (default: ${API_KEY_ENV})")


def drain(args: argparse.Namespace) -> int:
    return _post(args, "/admin/drain", {"worker": args.worker, "timeout_s": args.timeout_s})


def scale(args: argparse.Namespace) -> int:
    sizes = {pool: getattr(args, pool) for pool in ("prefill", "decode", "colocated") if getattr(args, pool)}
    return _post(args, "/admin/scale", {**sizes, "drain_timeout_s": args.drain_timeout_s})


def _post(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    """POST body; the answer to stdout as JSON (exit 0), or the router's error to stderr (exit 1)."""
    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(args.url.rstrip("/") + path, json.dumps(body).encode(), headers)
    try:
        # (a drain waits for its requests: no timeout of our own beyond theirs)
        with urllib.request.urlopen(request) as response:
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
