"""``/v1/completions`` and ``/v1/chat/completions``: the gRPC servicer's path, spoken in OpenAI's JSON.

The same admission bound, validation, backend and request metrics as
``router.server.GenerationServicer``. A non-streaming request runs buffered
(``generate_buffered``): its client sees nothing before the end, so a worker failing it
midway costs a rerun, not an error. Whatever ends a request early (the client goes away,
an error) closes the backend's stream, which aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from aiohttp import web

from tandem.router.backend import Backend, NoHealthyWorker, Overloaded
from tandem.router.buffered import generate_buffered, merged
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RequestTimer, RouterMetrics
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.protocol import CHAT, ParsedRequest, parse_request, validated
from tandem.router.openai.responses import DONE, Responses, new_id, sse, usage
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import ValidRequest
from tandem.worker.api import PoolFull, StreamDelta

logger = logging.getLogger(__name__)

# Order matters: the first matching class wins (Overloaded and PoolFull are RuntimeErrors).
# (class, HTTP status, OpenAI error type, code)
_ERRORS: tuple[tuple[type[BaseException], int, str, str | None], ...] = (
    (Overloaded, 429, "rate_limit_error", "rate_limit_exceeded"),
    (PoolFull, 429, "rate_limit_error", "rate_limit_exceeded"),
    (NoHealthyWorker, 503, "server_error", "service_unavailable"),
    (ValueError, 400, "invalid_request_error", None),
)
# What the router's metrics record for each HTTP status (they count gRPC codes).
_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.INVALID_ARGUMENT,
               413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               503: grpc.StatusCode.UNAVAILABLE}
RETRY_AFTER_S = 1
"""What a 429 tells the client to wait (OpenAI's client honours Retry-After)."""


class Generation:
    """Serves both generation endpoints over a Backend."""

    def __init__(self, backend: Backend, tokenizer: RouterTokenizer, metrics: RouterMetrics,
                 limits: RequestLimits) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._limits = limits
        self.model = tokenizer.spec.model_name

    async def handle(self, kind: str, request: web.Request) -> web.StreamResponse:
        """One request of ``kind`` (COMPLETION or CHAT); refusals raise APIError."""
        limit = self._limits.max_concurrent_requests
        if self._metrics.num_running >= limit:
            self._metrics.ended(grpc.StatusCode.RESOURCE_EXHAUSTED, rejected=True)
            raise APIError(429, f"{limit} requests are in progress, the limit max_concurrent_requests={limit}: "
                                "retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self._metrics.num_running += 1
        try:
            return await self._generate(kind, request)
        finally:
            self._metrics.num_running -= 1

    async def _generate(self, kind: str, request: web.Request) -> web.StreamResponse:
        timer = self._metrics.start_request()
        request_id = new_id(kind)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge as e:
                raise APIError(413, e.text or "the request body is too large") from e
            # Off the event loop, as the gRPC servicer tokenizes: a long prompt or
            # conversation takes milliseconds, and every other stream waits on this loop.
            parsed, valid = await asyncio.to_thread(self._prepare, kind, raw, request_id)
        except APIError as e:
            logger.info("rejected request %s: %s", request_id, e.message)
            self._metrics.ended(grpc.StatusCode.INVALID_ARGUMENT, rejected=True)
            raise
        logger.debug("request %s: %d prompt tokens, %s", request_id, len(valid.prompt_token_ids), valid.params)
        responses = Responses(kind, request_id, self.model, self._tokenizer, include_usage=parsed.include_usage)
        if parsed.stream:
            return await self._stream(request, parsed, valid, responses, timer)
        return await self._complete(valid, responses, timer)

    def _prepare(self, kind: str, raw: bytes, request_id: str) -> tuple[ParsedRequest, ValidRequest]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            raise invalid(None, "the request body is not valid JSON") from e
        parsed = parse_request(kind, body, self.model, request_id)
        return parsed, validated(parsed, self._tokenizer, self._limits)

    async def _complete(self, valid: ValidRequest, responses: Responses, timer: RequestTimer) -> web.Response:
        """The whole answer at once: one choice per completion index."""
        by_index: dict[int, list[StreamDelta]] = {}

        async def collect(delta: StreamDelta) -> None:
            by_index.setdefault(delta.index, []).append(delta)

        finished = await self._run(valid, timer, collect, buffered=True)
        choices = []
        for index in sorted(by_index):
            whole = merged(by_index[index])
            if whole.finish_reason not in ("stop", "length"):
                raise _aborted(valid.request_id)
            logprobs = responses.logprobs(index, whole.token_ids, whole.logprobs)
            choices.append(responses.choice(index, whole.text, whole.finish_reason, logprobs))
        body = responses.response(choices, usage(finished.num_prompt_tokens, finished.num_output_tokens))
        return web.json_response(body, dumps=_dumps, headers={"X-Request-Id": responses.id})

    async def _stream(self, request: web.Request, parsed: ParsedRequest, valid: ValidRequest,
                      responses: Responses, timer: RequestTimer) -> web.StreamResponse:
        """Server-sent events, each delta as it comes. The response starts with the first
        delta, so a refusal before it (overloaded, no worker) still gets its HTTP status."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", "X-Request-Id": responses.id})
        aborted = False

        async def write(*events: bytes) -> None:
            try:
                if not response.prepared:
                    await response.prepare(request)
                for event in events:
                    await response.write(event)
            except ConnectionResetError as e:  # aiohttp's word for a client gone away
                raise _ClientGone() from e

        async def send(delta: StreamDelta) -> None:
            nonlocal aborted
            if not response.prepared and parsed.kind == CHAT:
                await write(*(sse(responses.role_chunk(index)) for index in range(valid.params.n)))
            if aborted:
                return
            if delta.finish_reason == "abort":  # a success never ends "abort": the client gets an error
                aborted = True
                await write(sse(_aborted(valid.request_id).body()))
                return
            await write(*(sse(chunk) for chunk in _chunks(responses, delta)))

        try:
            try:
                finished = await self._run(valid, timer, send, buffered=False)
            except APIError as e:
                if not response.prepared:
                    raise
                # Too late for a status: OpenAI's client raises on an event carrying "error".
                await write(sse(e.body()))
                return response
            if not aborted:
                if parsed.include_usage:
                    await write(sse(responses.usage_chunk(usage(finished.num_prompt_tokens,
                                                                finished.num_output_tokens))))
                await write(DONE)
        except _ClientGone:
            pass  # counted as cancelled; aiohttp finishes the response quietly
        return response

    async def _run(self, valid: ValidRequest, timer: RequestTimer, send: Callable[[StreamDelta], Awaitable[None]],
                   *, buffered: bool) -> StreamDelta:
        """Relay the backend's deltas to ``send`` up to the request's last one -> that one.

        Records the request's metrics as the gRPC servicer does; a failure raises APIError.
        A client gone away surfaces here as CancelledError (aiohttp cancels the handler) or
        _ClientGone (a write failed): both count as CANCELLED and propagate.
        """
        request_id, prompt_token_ids, params = valid
        error: tuple[grpc.StatusCode, APIError] | None = None
        finished: StreamDelta | None = None
        stream: AsyncIterator[StreamDelta] | None = None
        try:
            stream = (generate_buffered(self._backend, request_id, prompt_token_ids, params, self._metrics.reruns.inc)
                      if buffered else self._backend.generate(request_id, prompt_token_ids, params))
            async for delta in stream:
                if getattr(delta, "error", None) is not None:
                    # Backends should raise instead; a failed request must not look finished.
                    raise NoHealthyWorker(f"request {request_id} failed on the workers: {delta.error}")
                await send(delta)
                timer.tokens_sent(len(delta.token_ids))
                if delta.request_finished:  # with n > 1, each completion's finish comes before it
                    finished = delta
                    break
            if finished is None:
                message = "the workers ended the stream before every completion finished"
                logger.error("request %s: %s", request_id, message)
                error = (grpc.StatusCode.INTERNAL, APIError(500, message, type="server_error"))
        except _ClientGone:
            pass  # counted as cancelled below, then raised again
        except Exception as e:  # noqa: BLE001 - every failure must reach the client as a status
            error = _error_of(request_id, e)
        finally:
            if finished is None and error is None:
                logger.info("request %s: cancelled after %.3f s", request_id, time.perf_counter() - timer.arrival)
                self._metrics.ended(grpc.StatusCode.CANCELLED, rejected=False)
            if stream is not None:
                await _close(stream)  # at once: closing it is what aborts the request on the workers
        if error is not None:
            self._metrics.ended(error[0], rejected=timer.first_token is None)
            raise error[1]
        if finished is None:
            raise _ClientGone()
        self._metrics.ended(grpc.StatusCode.OK, rejected=False)
        self._metrics.finished(finished.finish_reason, finished.num_prompt_tokens, finished.num_output_tokens)
        timer.finished(finished.num_output_tokens // params.n)  # TPOT is per sequence: n decode side by side
        logger.info("request %s: %s, %d prompt + %d output tokens in %.3f s", request_id, finished.finish_reason,
                    finished.num_prompt_tokens, finished.num_output_tokens, time.perf_counter() - timer.arrival)
        return finished


class _ClientGone(Exception):
    """A write to the client failed: it closed the connection."""


def _chunks(responses: Responses, delta: StreamDelta) -> list[dict]:
    """A delta's stream chunks (none for a delta that holds text back and carries nothing else)."""
    logprobs = responses.logprobs(delta.index, delta.token_ids, delta.logprobs) if delta.token_ids else None
    if responses.kind == CHAT:
        chunks = [responses.text_chunk(delta.index, delta.text, logprobs)] if delta.text or logprobs else []
        if delta.finish_reason is not None:
            chunks.append(responses.finish_chunk(delta.index, delta.finish_reason))
        return chunks
    if delta.text or logprobs or delta.finish_reason is not None:
        return [responses.text_chunk(delta.index, delta.text, logprobs, delta.finish_reason)]
    return []


def _aborted(request_id: str) -> APIError:
    # Aborted on purpose (the gRPC Abort rpc by this id): running it again would undo that.
    return APIError(500, f"request {request_id} was aborted on the server", type="server_error",
                    code="request_aborted", headers={"x-should-retry": "false"})


def _error_of(request_id: str, error: Exception) -> tuple[grpc.StatusCode, APIError]:
    if isinstance(error, APIError):
        return _GRPC_CODES.get(error.status, grpc.StatusCode.INTERNAL), error
    for cls, status, kind, code in _ERRORS:
        if isinstance(error, cls):
            logger.warning("request %s: %d: %s", request_id, status, error)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
            return _GRPC_CODES[status], APIError(status, str(error) or type(error).__name__, type=kind, code=code,
                                                 headers=headers)
    logger.exception("request %s failed", request_id, exc_info=error)
    return grpc.StatusCode.INTERNAL, APIError(500, f"internal error: {type(error).__name__}: {error}",
                                              type="server_error")


async def _close(stream: AsyncIterator[StreamDelta]) -> None:
    """Close the backend's stream (a no-op once it finished): closing is what aborts the request."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # noqa: BLE001 - the outcome is already decided; keep the cause in the log
        logger.exception("closing a backend stream failed")


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
