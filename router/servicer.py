"""``tandem.v1.Generation`` over a Backend: validate, tokenize, relay, and turn every outcome
into a status code (see ``_STATUS_OF``). Whatever ends a call early — client cancel, deadline,
an error — closes the backend's stream, which aborts the request on the workers and frees
its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc  # the servicer's base class
from tandem.router.backend import Backend, NoHealthyWorker, Overloaded
from tandem.router.buffered import generate_buffered
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.service import Unparsable
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import check_request_id, shown, validate_request
from tandem.worker.api import PoolFull, StreamDelta

logger = logging.getLogger(__name__)

MAX_ABORT_IDS = 1024

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
