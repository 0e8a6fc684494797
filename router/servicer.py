"""``tandem.v1.Generation`` over a Backend: validate, tokenize, relay (``RequestRelay``: admission,
the backend's stream, request metrics), and turn every outcome into a status code. Whatever
ends a call early — client cancel, deadline, an error — closes the backend's stream, which
aborts the request on the workers and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc  # the servicer's base class
from tandem.router.auth import ApiKeys
from tandem.router.backend import Backend
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.relay import RequestFailed, RequestRelay, failure_of
from tandem.router.service import Unparsable
from tandem.router.tenant_cache import for_tenant
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import check_request_id, shown, validate_request
from tandem.worker.api import StreamDelta

logger = logging.getLogger(__name__)

MAX_ABORT_IDS = 1024

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class GenerationServicer(pb_grpc.GenerationServicer):
    """``tandem.v1.Generation`` over a Backend."""

    def __init__(self, backend: Backend, tokenizer: RouterTokenizer, metrics: RouterMetrics,
                 limits: RequestLimits = RequestLimits(), keys: ApiKeys | None = None) -> None:
        """keys: the API keys, whose tenants own their requests (None: each connection owns
        its own): Abort reaches only the caller's."""
        self._backend = backend
        self._keys = keys
        self._tokenizer = tokenizer
        self._limits = limits
        self._relay = RequestRelay(backend, metrics, limits)

    async def Generate(self, request: pb.GenerateRequest | Unparsable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Unparsable):
            self._relay.count_invalid()
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        try:
            with self._relay.admitted() as timer:
                try:
                    # Off the event loop: a long prompt or conversation takes milliseconds to
                    # tokenize, and every other stream waits on this loop.
                    valid = await asyncio.to_thread(validate_request, request, self._tokenizer, self._limits)
                except ValueError as e:
                    logger.info("rejected request %s: %s", shown(request.request_id), e)
                    self._relay.count_invalid()
                    await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                logger.debug("request %s: %d prompt tokens, %s", valid.request_id, len(valid.prompt_token_ids),
                             valid.params)
                # grpc.aio ends a call early by cancelling this task (client cancel, deadline)
                # while it waits on the backend, or by closing this generator while it waits
                # to write: the relay counts either and closes the backend's stream.
                owned = for_tenant(valid, self._tenant(context))._replace(
                    request_id=owned_id(self._owner(context), valid.request_id))
                async with self._relay.relay(owned, timer, buffered=request.buffered,
                                             deadline_passed=lambda: _deadline_passed(context)) as deltas:
                    async for delta in deltas:
                        yield _response(valid.request_id, delta)
        except RequestFailed as failure:  # AdmissionRefused included
            await _abort(context, failure.code, failure.message)

    async def Abort(self, request: pb.AbortRequest | Unparsable, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, Unparsable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        if len(request.request_ids) > MAX_ABORT_IDS:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_ids: at most {MAX_ABORT_IDS} ids per call, got {len(request.request_ids)}")
        try:
            for i, request_id in enumerate(request.request_ids):
                check_request_id(request_id, f"request_ids[{i}]")
        except ValueError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        aborted: list[str] = []
        error: RequestFailed | None = None
        try:
            owner = self._owner(context)
            for request_id in dict.fromkeys(request.request_ids):  # once each, in order
                # NOTE: another owner's id is never found: Abort neither ends it nor tells it exists.
                if await self._backend.abort(owned_id(owner, request_id)):
                    aborted.append(request_id)
        except Exception as e:  # noqa: BLE001
            error = failure_of("(abort)", e)
        if error is not None:
            await _abort(context, error.code, error.message)
        logger.info("abort: %d of %d requests were running: %s", len(aborted), len(request.request_ids), aborted)
        return pb.AbortResponse(aborted_request_ids=aborted)

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        """Who owns the call's requests: its key's tenant, or (without keys) its connection."""
        tenant = self._tenant(context)
        return f"peer {context.peer()}" if tenant is None else f"tenant {tenant}"

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        """The call's key's tenant (None without keys)."""
        if self._keys is None:
            return None
        metadata = dict(context.invocation_metadata() or ())
        return self._keys.tenant_of(metadata.get("authorization", ""))


def owned_id(owner: str, request_id: str) -> str:
    """The id the backend knows a client's request by: its owner's and its own, so that
    owners never meet each other's requests, whatever ids they pick."""
    return f"{owner.replace('/', '%2F')}/{request_id}"


def _response(request_id: str, delta: StreamDelta) -> pb.GenerateResponse:
    """A delta as the client sees it: finish_reason on each completion's last message, usage
    (every completion's tokens) on the request's last only."""
    response = pb.GenerateResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                   index=delta.index)
    if delta.logprobs is not None:
        response.logprobs.extend(delta.logprobs)
    for top in delta.top_logprobs or ():  # sampling.logprobs >= 1: one entry per token
        response.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[delta.finish_reason]
    if delta.request_finished:
        response.usage.prompt_tokens = delta.num_prompt_tokens
        response.usage.completion_tokens = delta.num_output_tokens
    return response


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort``, which always raises (grpc.aio's AbortError), typed as such."""
    await context.abort(code, details)
    raise AssertionError("grpc.aio's ServicerContext.abort returned")


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
