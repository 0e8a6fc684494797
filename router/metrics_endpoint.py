"""`/metrics` over HTTP: the router's registry (its own metrics and the workers')."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9464


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


def start_metrics_endpoint(registry: CollectorRegistry, host: str = "127.0.0.1",
                           port: int = DEFAULT_METRICS_PORT) -> MetricsEndpoint:
    """Serve `registry` at http://host:port/metrics (loopback unless told otherwise; port 0
    picks a free one) on a thread of its own."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {host}:{port}: {e}") from e
    endpoint = MetricsEndpoint(server, thread)
    logger.info("metrics on http://%s:%d/metrics", host, endpoint.port)
    return endpoint
