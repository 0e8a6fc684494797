"""The router's gRPC front door: ``tandem.v1.Generation`` on grpc.aio, with health and reflection.

The servicer only validates, tokenizes and relays: everything about workers sits behind
``router.backend.Backend``. Its exceptions become status codes (see ``_STATUS_OF``), and
whatever ends a call early — client cancel, deadline, an error — closes the backend's
stream, which aborts the request on the workers and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc  # the servicer's base class
from tandem.router.auth import TokenAuthInterceptor
from tandem.router.backend import Backend, NoHealthyWorker, Overloaded
from tandem.router.buffered import generate_buffered
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.metrics_endpoint import MetricsEndpoint, start_metrics_endpoint
from tandem.router.service import SERVICE_NAME, Unparsable, add_generation_service
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import check_request_id, shown, validate_request
from tandem.router.worker_metrics import WorkerMetricsCollector, WorkerMetricsReport
from tandem.worker_api import PoolFull, StreamDelta

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.5
"""How often health follows backend.is_ready()."""
MAX_ABORT_IDS = 1024
WORKER_METRICS_WAIT_S = 3.0
"""How long a scrape waits for the workers' metrics (each worker has less; see RayBackend)."""

# Order matters: the first matching class wins (Overloaded and PoolFull are RuntimeErrors).
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoHealthyWorker, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class GenerationServicer(pb_grpc.GenerationServicer):
    """``tandem.v1.Generation`` over a Backend."""

    def __init__(self, backend: Backend, tokenizer: RouterTokenizer, metrics: RouterMetrics,
                 limits: RequestLimits = RequestLimits()) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._limits = limits

    async def Generate(self, request: pb.GenerateRequest | Unparsable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Unparsable):
            self._metrics.ended(grpc.StatusCode.INVALID_ARGUMENT, rejected=True)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        limit = self._limits.max_concurrent_requests
        if self._metrics.num_running >= limit:
            self._metrics.ended(grpc.StatusCode.RESOURCE_EXHAUSTED, rejected=True)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{limit} requests are in progress, the limit max_concurrent_requests={limit}: retry later")
        self._metrics.num_running += 1
        responses = self._generate(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()  # at once: closing it is what aborts the request on the workers
            self._metrics.num_running -= 1

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        timer = self._metrics.start_request()
        try:
            # Off the event loop: a long prompt or conversation takes milliseconds to
            # tokenize, and every other stream waits on this loop.
            request_id, prompt_token_ids, params = await asyncio.to_thread(
                validate_request, request, self._tokenizer, self._limits)
        except ValueError as e:
            logger.info("rejected request %s: %s", shown(request.request_id), e)
            self._metrics.ended(grpc.StatusCode.INVALID_ARGUMENT, rejected=True)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.debug("request %s: %d prompt tokens, %s", request_id, len(prompt_token_ids), params)
        error: tuple[grpc.StatusCode, str] | None = None
        finished: StreamDelta | None = None
        stream: AsyncIterator[StreamDelta] | None = None
        try:
            stream = (generate_buffered(self._backend, request_id, prompt_token_ids, params, self._metrics.reruns.inc)
                      if request.buffered else self._backend.generate(request_id, prompt_token_ids, params))
            async for delta in stream:
                if getattr(delta, "error", None) is not None:
                    # Backends should raise instead; a failed request must not look finished.
                    raise NoHealthyWorker(f"request {request_id} failed on the workers: {delta.error}")
                yield _response(request_id, delta)
                timer.tokens_sent(len(delta.token_ids))
                if delta.request_finished:  # with n > 1, each completion's finish comes before it
                    finished = delta
                    break
            if finished is None:
                error = (grpc.StatusCode.INTERNAL, "the workers ended the stream before every completion finished")
                logger.error("request %s: %s", request_id, error[1])
        except Exception as e:  # noqa: BLE001 - every failure must reach the client as a status
            error = _status_of(request_id, e)
        finally:
            # Also reached when the call ends early: grpc.aio cancels this task (client
            # cancel, deadline) while it waits on the backend, or closes this generator
            # while it waits to write. Either way the backend stream must close, which is
            # what aborts the request on the workers and frees its blocks.
            if finished is None and error is None:
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                logger.info("request %s: %s after %.3f s", request_id, "deadline exceeded" if expired else "cancelled",
                            time.perf_counter() - timer.arrival)
                self._metrics.ended(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED,
                                    rejected=False)
            if stream is not None:
                await _close(stream)
        if error is not None:
            self._metrics.ended(error[0], rejected=timer.first_token is None)
            await context.abort(*error)
        self._metrics.ended(grpc.StatusCode.OK, rejected=False)
        self._metrics.finished(finished.finish_reason, finished.num_prompt_tokens, finished.num_output_tokens)
        timer.finished(finished.num_output_tokens // params.n)  # TPOT is per sequence: n decode side by side
        logger.info("request %s: %s, %d prompt + %d output tokens in %.3f s", request_id, finished.finish_reason,
                    finished.num_prompt_tokens, finished.num_output_tokens, time.perf_counter() - timer.arrival)

    async def Abort(self, request: pb.AbortRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        if len(request.request_ids) > MAX_ABORT_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_ids: at most {MAX_ABORT_IDS} ids per call, got {len(request.request_ids)}")
        try:
            for i, request_id in enumerate(request.request_ids):
                check_request_id(request_id, f"request_ids[{i}]")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        aborted: list[str] = []
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            for request_id in dict.fromkeys(request.request_ids):  # once each, in order
                if await self._backend.abort(request_id):
                    aborted.append(request_id)
        except Exception as e:  # noqa: BLE001
            error = _status_of("(abort)", e)
        if error is not None:
            await context.abort(*error)
        logger.info("abort: %d of %d requests were running: %s", len(aborted), len(request.request_ids), aborted)
        return pb.AbortResponse(aborted_request_ids=aborted)


def _response(request_id: str, delta: StreamDelta) -> pb.GenerateResponse:
    """A delta as the client sees it: finish_reason on each completion's last message, usage
    (every completion's tokens) on the request's last only."""
    response = pb.GenerateResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                   index=delta.index)
    if delta.logprobs is not None:
        response.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[delta.finish_reason]
    if delta.request_finished:
        response.usage.prompt_tokens = delta.num_prompt_tokens
        response.usage.completion_tokens = delta.num_output_tokens
    return response


def _status_of(request_id: str, error: Exception) -> tuple[grpc.StatusCode, str]:
    for cls, code in _STATUS_OF:
        if isinstance(error, cls):
            logger.warning("request %s: %s: %s", request_id, code.name, error)
            return code, str(error) or type(error).__name__
    logger.exception("request %s failed", request_id, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


async def _close(stream: AsyncIterator[StreamDelta]) -> None:
    """Close the backend's stream (a no-op once it finished): closing is what aborts the request."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # noqa: BLE001 - the call's outcome is already decided; keep the cause in the log
        logger.exception("closing a backend stream failed")


@dataclass
class _Router:
    """What serve() started next to the grpc server, for drain() and bound_port()."""

    health: HealthServicer
    health_task: asyncio.Task[None]
    port: int
    metrics_endpoint: MetricsEndpoint | None


_ROUTERS: weakref.WeakKeyDictionary[grpc.aio.Server, _Router] = weakref.WeakKeyDictionary()


async def serve(backend: Backend, host: str = "127.0.0.1", port: int = 50051, *,
                tokenizer: RouterTokenizer | None = None, metrics_port: int | None = None,
                auth_token: str | None = None, health_poll_s: float = HEALTH_POLL_S,
                limits: RequestLimits | None = None) -> grpc.aio.Server:
    """Start the router on ``host:port`` (loopback unless told otherwise; port 0 picks a free
    one, see ``bound_port``) -> the started server. Health says NOT_SERVING until
    ``backend.is_ready()``, then follows it; ``drain(server)`` is the way to stop.

    The tokenizer defaults to the one the backend describes (``backend.tokenizer_spec``).
    metrics_port: also serve ``/metrics`` (the router's and its workers' metrics) on
    ``host:metrics_port`` (None: not over HTTP). auth_token: calls must carry
    ``authorization: Bearer <auth_token>`` (health checks excepted). limits: what one
    request may cost (default ``RequestLimits()``; past them, INVALID_ARGUMENT naming the limit).
    """
    tokenizer = tokenizer or RouterTokenizer.from_spec(backend.tokenizer_spec)
    metrics = _router_metrics(backend, tokenizer)
    interceptors = [TokenAuthInterceptor(auth_token)] if auth_token else []
    # so_reuseport=0: a second router on a busy port must fail, not share the port.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    add_generation_service(GenerationServicer(backend, tokenizer, metrics, limits or RequestLimits()), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpc's word for a failed bind
        raise OSError(f"cannot listen on {host}:{port}: {e}") from e
    if bound == 0:  # older grpc reports a failed bind this way
        raise OSError(f"cannot listen on {host}:{port}")
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    endpoint = None if metrics_port is None else start_metrics_endpoint(metrics.registry, host, metrics_port)
    try:
        await server.start()
    except BaseException:
        if endpoint is not None:
            endpoint.stop()
        raise
    task = asyncio.create_task(_follow_readiness(backend, health, health_poll_s), name="tandem-router-health")
    _ROUTERS[server] = _Router(health, task, bound, endpoint)
    logger.info("router serving %s on %s:%d (model %s%s)", SERVICE_NAME, host, bound, tokenizer.spec.model_name,
                ", token required" if auth_token else "")
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
    backend.metrics = metrics
    return metrics


def bound_port(server: grpc.aio.Server) -> int:
    """The port a server from serve() listens on (what port 0 became)."""
    return _ROUTERS[server].port


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
