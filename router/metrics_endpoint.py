"""`/metrics` over HTTP: the router's registry (its own metrics and the workers').

A scrape is not free (it asks every worker for its metrics): at most MAX_SCRAPES run at once,
more are answered 503 at once; with a token set, a scrape must carry `Authorization: Bearer`."""

from __future__ import annotations

import hmac
import logging
import socketserver
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9464
METRICS_TOKEN_ENV = "TANDEM_METRICS_TOKEN"
MAX_SCRAPES = 4
"""Scrapes answered at once; Prometheus sends one per target and interval."""


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per scrape would drown the router's log


def _guarded(app: Callable, token: str | None, max_scrapes: int) -> Callable:
    expected = None if token is None else f"Bearer {token}".encode()
    slots = threading.BoundedSemaphore(max_scrapes)

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if expected is not None and not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a metrics token is required: Authorization: Bearer <token>\n"]
        if not slots.acquire(blocking=False):
            start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Retry-After", "1")])
            return [f"{max_scrapes} scrapes are in progress: retry later\n".encode()]
        try:
            return list(app(environ, start_response))
        finally:
            slots.release()
    return guarded


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_endpoint(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = DEFAULT_METRICS_PORT,
                           token: str | None = None, max_scrapes: int = MAX_SCRAPES) -> MetricsEndpoint:
    """Serve `registry` at http://host:port/metrics (loopback unless told otherwise; port 0
    picks a free one) on a thread of its own. token: scrapes must carry it (None: open)."""
    try:
        server = make_server(host, port, _guarded(make_wsgi_app(registry), token, max_scrapes),
                             server_class=_Server, handler_class=_QuietHandler)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {host}:{port}: {e}") from e
    thread = threading.Thread(target=server.serve_forever, name="tandem-metrics", daemon=True)
    thread.start()
    endpoint = MetricsEndpoint(server, thread)
    logger.info("metrics on http://%s:%d/metrics%s", host, endpoint.port, ", token required" if token else "")
    return endpoint
