"""The router's front door: ``tandem.v1.Generation`` on grpc.aio (router/servicer.py), with
health and reflection, its /metrics, and optionally the OpenAI-compatible HTTP API
(router/openai/) on the same event loop, backend, limits and metrics.

Everything about workers sits behind ``router.backend.Backend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tandem.router.auth import ApiKeys, TokenAuthInterceptor
from tandem.router.backend import Backend
from tandem.router.kv_index_metrics import KVIndexCollector
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.metrics_endpoint import MetricsEndpoint, start_metrics_endpoint
from tandem.router.openai.app import OpenAIEndpoint, start_openai_endpoint
from tandem.router.service import SERVICE_NAME, add_generation_service
from tandem.router.servicer import GenerationServicer
from tandem.router.tls import TLSFiles
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.worker_metrics import WorkerMetricsCollector, WorkerMetricsReport

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
"""How often health follows backend.is_ready()."""
MAX_STREAMS_PER_CONNECTION = 1024
"""HTTP/2 streams one client connection may have open at once (more wait in the client)."""
LIVENESS_SERVICE = "tandem.liveness"
"""The health service a liveness probe asks: SERVING while the router's event loop answers,
whatever the workers' state (the "" service follows readiness: a pool restarting must not
get the router, and every worker it owns, killed)."""
WORKER_METRICS_WAIT_S = 3.0
"""How long a scrape waits for the workers' metrics (each worker has less; see RayBackend)."""


@dataclass
class _Router:
    """What serve() started next to the grpc server, for drain() and bound_port()."""

    health: HealthServicer
    health_task: asyncio.Task[None]
    port: int
    metrics_endpoint: MetricsEndpoint | None
    openai_endpoint: OpenAIEndpoint | None


_ROUTERS: weakref.WeakKeyDictionary[grpc.aio.Server, _Router] = weakref.WeakKeyDictionary()


async def serve(backend: Backend, host: str = "127.0.0.1", port: int = 50051, *,
                tokenizer: RouterTokenizer | None = None, metrics_port: int | None = None,
                auth_token: str | ApiKeys | None = None, health_poll_s: float = HEALTH_POLL_S,
                limits: RequestLimits | None = None, http_port: int | None = None,
                tls: TLSFiles | None = None, metrics_token: str | None = None,
                served_model_names: Sequence[str] | None = None, chat_template: str | None = None,
                admin_key: str | None = None) -> grpc.aio.Server:
    """Start the router on ``host:port`` (loopback unless told otherwise; port 0 picks a free
    one, see ``bound_port``) -> the started server. Health says NOT_SERVING until
    ``backend.is_ready()``, then follows it; ``drain(server)`` is the way to stop.

    The tokenizer defaults to the one the backend describes (``backend.tokenizer_spec``).
    metrics_port: also serve ``/metrics`` (the router's and its workers' metrics) on
    ``host:metrics_port`` (None: not over HTTP). auth_token: calls must carry
    ``authorization: Bearer <key>`` with this key, or one of these (health checks excepted);
    a key's tenant owns its requests (without keys, a connection does). limits: what one
    request may cost (default ``RequestLimits()``; past them, INVALID_ARGUMENT naming the limit).
    http_port: also serve the OpenAI-compatible HTTP API on ``host:http_port`` (same backend,
    limits, token and metrics; see ``http_port(server)``; None: not at all).
    tls: serve gRPC and HTTP over TLS with this certificate (None: plaintext).
    metrics_token: scrapes of ``/metrics`` must carry ``Authorization: Bearer <metrics_token>``.
    served_model_names: the names the OpenAI API answers to (the first is the one it reports,
    and the metrics' model_name; default: the model's). chat_template: render chat messages
    with this template instead of the model's. admin_key: the only key the admin routes
    (draining, scaling: router/openai/admin_routes.py) take.
    """
    if tokenizer is None:
        spec = backend.tokenizer_spec
        spec = dataclasses.replace(spec, model_name=served_model_names[0] if served_model_names else spec.model_name,
                                   chat_template=spec.chat_template if chat_template is None else chat_template)
        tokenizer = RouterTokenizer.from_spec(spec)
    model_names = tuple(served_model_names or (tokenizer.spec.model_name,))
    limits = limits or RequestLimits()
    metrics = _router_metrics(backend, tokenizer)
    keys = ApiKeys.of(auth_token)
    interceptors = [TokenAuthInterceptor(keys)] if keys else []
    # so_reuseport=0: a second router on a busy port must fail, not share the port. A message
    # longer than a request may be is refused from its length prefix, before it is read.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", limits.max_body_bytes),
                                      ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)],
                             interceptors=interceptors)
    add_generation_service(GenerationServicer(backend, tokenizer, metrics, limits, keys), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        bound = (server.add_insecure_port(f"{host}:{port}") if tls is None
                 else server.add_secure_port(f"{host}:{port}", tls.grpc_credentials()))
    except RuntimeError as e:  # grpc's word for a failed bind
        raise OSError(f"cannot listen on {host}:{port}: {e}") from e
    if bound == 0:  # older grpc reports a failed bind this way
        raise OSError(f"cannot listen on {host}:{port}")
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    endpoint = None if metrics_port is None else start_metrics_endpoint(metrics.registry, host, metrics_port,
                                                                                  token=metrics_token)
    openai_endpoint = None
    try:
        if http_port is not None:
            openai_endpoint = await start_openai_endpoint(backend, tokenizer, metrics, limits, host, http_port, keys,
                                                          ssl_context=None if tls is None else tls.ssl_context(),
                                                          model_names=model_names, metrics_token=metrics_token,
                                                          admin_key=admin_key)
        await server.start()
        await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if endpoint is not None:
            endpoint.stop()
        if openai_endpoint is not None:
            await openai_endpoint.stop()
        raise
    task = asyncio.create_task(_follow_readiness(backend, health, health_poll_s), name="tandem-router-health")
    _ROUTERS[server] = _Router(health, task, bound, endpoint, openai_endpoint)
    logger.info("router serving %s on %s:%d (model %s%s)", SERVICE_NAME, host, bound, tokenizer.spec.model_name,
                ", token required" if keys else "")
    return server


def _router_metrics(backend: Backend, tokenizer: RouterTokenizer) -> RouterMetrics:
    """The router's metrics and, gathered at each scrape, its workers'."""
    spec = tokenizer.spec
    metrics = RouterMetrics(spec.model_name, spec.max_model_len, num_waiting=lambda: backend.num_admitting)
    loop = asyncio.get_running_loop()

    def fetch() -> list[WorkerMetricsReport]:
        # NOTE: runs on the scraping thread, never on this loop (it would wait on itself).
        return asyncio.run_coroutine_threadsafe(backend.worker_metrics(), loop).result(timeout=WORKER_METRICS_WAIT_S)

    metrics.registry.register(WorkerMetricsCollector(spec.model_name, fetch))
    index = getattr(backend, "kv_index", None)
    if index is not None:  # --policy precise_prefix
        metrics.registry.register(KVIndexCollector(spec.model_name, index))
    backend.metrics = metrics
    return metrics


def bound_port(server: grpc.aio.Server) -> int:
    """The port a server from serve() listens on (what port 0 became)."""
    return _ROUTERS[server].port


def http_port(server: grpc.aio.Server) -> int | None:
    """The port a server from serve() serves the OpenAI-compatible API on (None: not over HTTP)."""
    endpoint = _ROUTERS[server].openai_endpoint
    return None if endpoint is None else endpoint.port


def metrics_port(server: grpc.aio.Server) -> int | None:
    """The port a server from serve() serves /metrics on (None: not over HTTP)."""
    endpoint = _ROUTERS[server].metrics_endpoint
    return None if endpoint is None else endpoint.port


async def drain(server: grpc.aio.Server, grace: float | None = 5.0) -> None:
    """Stop a server from serve(): health turns NOT_SERVING first (so load balancers stop
    sending), then running calls get ``grace`` seconds before they are cancelled."""
    router = _ROUTERS.pop(server, None)
    if router is not None:
        router.health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await router.health_task
        await router.health.enter_graceful_shutdown()
    logger.info("router draining (grace %s s)", grace)
    if router is not None and router.openai_endpoint is not None:
        await router.openai_endpoint.stop()
    await server.stop(grace)
    if router is not None and router.metrics_endpoint is not None:
        router.metrics_endpoint.stop()


async def _follow_readiness(backend: Backend, health: HealthServicer, interval: float) -> None:
    """Keep health in step with backend.is_ready() (workers may come and go)."""
    serving: bool | None = None
    while True:
        try:
            ready = bool(backend.is_ready())
        except Exception:  # noqa: BLE001 - a failing readiness check means not ready
            logger.exception("backend.is_ready() failed")
            ready = False
        if ready != serving:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE_NAME):
                await health.set(service, status)
            logger.info("health: %s", "SERVING" if ready else "NOT_SERVING")
            serving = ready
        await asyncio.sleep(interval)
