"""One request's way from a front door to the workers and back, shared by the gRPC servicer
(``router.servicer``) and the OpenAI-compatible API (``router.openai.generation``).

``RequestRelay`` owns what both front doors must do alike: the admission bound
(``max_concurrent_requests``), running the backend's stream for a validated request, the
request metrics of every outcome (OK, cancelled, deadline exceeded, each error), and
closing the backend's stream on every exit path. A request that does not end OK raises
``RequestFailed`` carrying the gRPC status it counts as (the metrics count gRPC codes) and
the message its client gets; each front door only turns that into its own answer (a gRPC
status; an HTTP status with OpenAI's error body) and formats the deltas.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from tandem.router.backend import Backend, NoHealthyWorker, Overloaded
from tandem.router.buffered import generate_buffered
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RequestTimer, RouterMetrics
from tandem.router.migration import generate_migrating
from tandem.router.validation import ValidRequest
from tandem.worker.api import PoolFull, StreamDelta

logger = logging.getLogger(__name__)

# Order matters: the first matching class wins (Overloaded and PoolFull are RuntimeErrors).
# Anything else is INTERNAL.
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoHealthyWorker, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


class RequestFailed(Exception):
    """A request that did not end OK: the gRPC status it ends with (what the request metrics
    count, whichever front door it came through) and the message its client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AdmissionRefused(RequestFailed):
    """max_concurrent_requests calls are already in progress: RESOURCE_EXHAUSTED at once,
    before any worker sees the request (what bounds the queues under overload)."""

    def __init__(self, limit: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{limit} requests are in progress, the limit max_concurrent_requests={limit}: retry later")


class ClientGone(Exception):
    """Raised by a front door when its client went away (a write failed): the request counts
    as cancelled, and this exception passes through the relay unchanged."""


def failure_of(request_id: str, error: Exception) -> RequestFailed:
    """An exception from the backend (or from relaying its deltas) as the failure the client gets."""
    for cls, code in _STATUS_OF:
        if isinstance(error, cls):
            logger.warning("request %s: %s: %s", request_id, code.name, error)
            failure = RequestFailed(code, str(error) or type(error).__name__)
            break
    else:
        logger.exception("request %s failed", request_id, exc_info=error)
        failure = RequestFailed(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure


class RelayedStream:
    """One request's deltas from the backend, up to the request's last one (``finished``).

    A delta counts as sent to the client (TTFT, inter-token latency) when the caller asks
    for the next one, that is once it has written the delta out.
    """

    def __init__(self, backend_stream: AsyncIterator[StreamDelta], request_id: str, timer: RequestTimer) -> None:
        self.backend_stream = backend_stream
        self.finished: StreamDelta | None = None
        """The request's last delta (usage: every completion's tokens), once the caller took it."""
        self.ended_early = False
        """Whether the backend's stream ended before the request's last delta."""
        self._deltas = aiter(backend_stream)
        self._request_id = request_id
        self._timer = timer
        self._sent: StreamDelta | None = None

    def __aiter__(self) -> RelayedStream:
        return self

    async def __anext__(self) -> StreamDelta:
        sent, self._sent = self._sent, None
        if sent is not None:  # the caller is done with it: it went to the client
            self._timer.tokens_sent(len(sent.token_ids))
            if sent.request_finished:  # with n > 1, each completion's finish comes before it
                self.finished = sent
        if self.finished is not None or self.ended_early:
            raise StopAsyncIteration
        try:
            delta = await anext(self._deltas)
        except StopAsyncIteration:
            self.ended_early = True
            raise
        if getattr(delta, "error", None) is not None:
            # Backends should raise instead; a failed request must not look finished.
            raise NoHealthyWorker(f"request {self._request_id} failed on the workers: {delta.error}")
        self._sent = delta
        return delta


class RequestRelay:
    """Admits requests and relays them to the backend, with the request metrics of each outcome."""

    def __init__(self, backend: Backend, metrics: RouterMetrics, limits: RequestLimits) -> None:
        self._backend = backend
        self._metrics = metrics
        self._limits = limits

    @contextlib.contextmanager
    def admitted(self) -> Iterator[RequestTimer]:
        """Hold one of the max_concurrent_requests places for the with-block -> the request's
        clock (started now: TTFT covers validation and tokenizing).

        Raises AdmissionRefused (counted as a rejected RESOURCE_EXHAUSTED) when none is free.
        """
        limit = self._limits.max_concurrent_requests
        if self._metrics.num_running >= limit:
            self._metrics.ended(grpc.StatusCode.RESOURCE_EXHAUSTED, rejected=True)
            raise AdmissionRefused(limit)
        self._metrics.num_running += 1
        try:
            yield self._metrics.start_request()
        finally:
            self._metrics.num_running -= 1

    def count_invalid(self) -> None:
        """A request refused as malformed or invalid before any worker saw it (the front door
        answers it): counted as a rejected INVALID_ARGUMENT."""
        self._metrics.ended(grpc.StatusCode.INVALID_ARGUMENT, rejected=True)

    @contextlib.asynccontextmanager
    async def relay(self, request: ValidRequest, timer: RequestTimer, *, buffered: bool = False,
                    deadline_passed: Callable[[], bool] = lambda: False) -> AsyncIterator[RelayedStream]:
        """Run ``request`` on the backend -> its deltas, to be sent to the client inside the block.

        buffered: run it through ``generate_buffered`` (one merged delta per completion at the
        end; a worker failing it midway runs it again); else through ``generate_migrating`` (a
        worker failing it midway: it goes on elsewhere). Leaving the block with the request's
        last delta taken records it as OK. A failure, from the backend or from the block
        (anything but ClientGone), raises RequestFailed. Leaving it early otherwise (the
        block breaks, ClientGone, the task cancelled, the front door's generator closed)
        counts as cancelled, or as deadline exceeded when ``deadline_passed()``; those
        exceptions propagate unchanged.
        """
        request_id, prompt_token_ids, params, priority = request
        failure: RequestFailed | None = None
        deltas: RelayedStream | None = None
        try:
            deltas = RelayedStream(
                generate_buffered(self._backend, request_id, prompt_token_ids, params, self._metrics.reruns.inc,
                                  priority=priority)
                if buffered else generate_migrating(self._backend, request_id, prompt_token_ids, params, priority,
                                                    self._limits.max_migrations,
                                                    self._metrics.migration_seconds.observe),
                request_id, timer)
            yield deltas
            if deltas.finished is None and deltas.ended_early:
                failure = RequestFailed(grpc.StatusCode.INTERNAL,
                                        "the workers ended the stream before every completion finished")
                logger.error("request %s: %s", request_id, failure.message)
        except ClientGone:
            raise  # counted as cancelled below
        except Exception as e:  # noqa: BLE001 - every failure must reach the client as a status
            failure = failure_of(request_id, e)
        finally:
            # Also reached when the request ends early: its task cancelled (client cancel,
            # deadline) while it waits on the backend, or the front door's generator closed
            # while it waits to write.
            if failure is None and (deltas is None or deltas.finished is None):
                expired = deadline_passed()
                logger.info("request %s: %s after %.3f s", request_id, "deadline exceeded" if expired else "cancelled",
                            time.perf_counter() - timer.arrival)
                self._metrics.ended(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED,
                                    rejected=False)
            if deltas is not None:
                # NOTE: on every exit path, at once: closing the backend's stream is what
                # aborts the request on the workers and frees its KV blocks.
                await _close(deltas.backend_stream)
        if failure is not None:
            self._metrics.ended(failure.code, rejected=timer.first_token is None)
            raise failure
        assert deltas is not None  # only None when RelayedStream() raised: then failure is set
        finished = deltas.finished
        if finished is None:
            return  # the block stopped before the end: counted as cancelled above
        assert finished.finish_reason is not None  # the request's last delta, with no error
        self._metrics.ended(grpc.StatusCode.OK, rejected=False)
        self._metrics.finished(finished.finish_reason, finished.num_prompt_tokens, finished.num_output_tokens)
        timer.finished(finished.num_output_tokens // params.n)  # TPOT is per sequence: n decode side by side
        logger.info("request %s: %s, %d prompt + %d output tokens in %.3f s", request_id, finished.finish_reason,
                    finished.num_prompt_tokens, finished.num_output_tokens, time.perf_counter() - timer.arrival)


async def _close(stream: AsyncIterator[StreamDelta]) -> None:
    """Close the backend's stream (a no-op once it finished): closing is what aborts the request."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # noqa: BLE001 - the outcome is already decided; keep the cause in the log
        logger.exception("closing a backend stream failed")
