"""``/v1/completions`` and ``/v1/chat/completions``: the gRPC servicer's path, spoken in OpenAI's JSON.

The same admission bound, backend and request metrics as ``router.servicer.GenerationServicer``:
both relay requests through ``router.relay.RequestRelay``. A non-streaming request runs buffered
(``generate_buffered``): its client sees nothing before the end, so a worker failing it
midway costs a rerun, not an error. A completions request with a list of prompts runs each
as a request of its own, all at once (``fanout.PromptRuns``). Whatever ends a request early
(the client goes away, an error, another prompt's failure) closes the backend's stream,
which aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence

import grpc
from aiohttp import web

from tandem.router.backend import Backend
from tandem.router.buffered import merged
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RequestTimer, RouterMetrics
from tandem.router.openai.body_budget import BodyBudget
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.fanout import PromptRuns
from tandem.router.openai.prompts import Prompt
from tandem.router.openai.protocol import CHAT, ParsedRequest, parse_request
from tandem.router.openai.responses import DONE, Responses, new_id, sse, usage
from tandem.router.openai.validated import validated_all
from tandem.router.relay import ClientGone, RequestFailed, RequestRelay, failure_of
from tandem.router.tenant_cache import for_tenant
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import ValidRequest, check_request_id
from tandem.worker.api import StreamDelta

logger = logging.getLogger(__name__)

# How a failed request is answered, by the gRPC status the relay gives it: (HTTP status,
# OpenAI error type, code). Anything else is a 500.
_HTTP_ERRORS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
}
RETRY_AFTER_S = 1
"""What a 429 tells the client to wait (OpenAI's client honours Retry-After)."""

TENANT_KEY = web.RequestKey("tandem.tenant", str)
"""Where the auth middleware leaves a request's tenant (whose prefix cache it uses)."""


class Generation:
    """Serves both generation endpoints over a Backend."""

    def __init__(self, backend: Backend, tokenizer: RouterTokenizer, metrics: RouterMetrics,
                 limits: RequestLimits, model_names: Sequence[str] | None = None) -> None:
        """model_names: what requests may give as ``model``; the first is the one reported
        (default: the tokenizer's model name)."""
        self._tokenizer = tokenizer
        self._limits = limits
        self._relay = RequestRelay(backend, metrics, limits)
        self._bodies = BodyBudget(limits)
        self.model_names = tuple(model_names or (tokenizer.spec.model_name,))
        self.model = self.model_names[0]

    async def handle(self, kind: str, request: web.Request) -> web.StreamResponse:
        """One request of ``kind`` (COMPLETION or CHAT); refusals raise APIError."""
        try:
            with self._relay.admitted() as timer:
                return await self._generate(kind, request, timer)
        except RequestFailed as failure:  # AdmissionRefused included
            raise _api_error(failure) from failure

    async def _generate(self, kind: str, request: web.Request, timer: RequestTimer) -> web.StreamResponse:
        request_id = new_id(kind)
        try:
            async with self._bodies.body(request) as raw:
                # Off the event loop, as the gRPC servicer tokenizes: a long prompt or
                # conversation takes milliseconds, and every other stream waits on this loop.
                parsed, valids = await asyncio.to_thread(self._prepare, kind, raw, request_id)
            valids = [for_tenant(valid, request.get(TENANT_KEY)) for valid in valids]
        except APIError as e:
            logger.info("rejected request %s: %s", request_id, e.message)
            self._relay.count_invalid()
            raise
        logger.debug("request %s: %s prompt tokens, %s", request_id, [len(v.prompt_token_ids) for v in valids],
                      valids[0].params)
        # The client's X-Request-Id names the response (for its tracing); the workers keep a
        # unique id of the router's, so that two clients' ids never meet there.
        response_id = _client_request_id(request) or request_id
        if response_id != request_id:
            logger.debug("request %s is the client's %s", request_id, response_id)
        responses = Responses(kind, response_id, self.model, self._tokenizer, include_usage=parsed.include_usage)
        echoes = [self._echo_text(parsed, parsed.prompts[i] if parsed.prompts else "", valid)
                  for i, valid in enumerate(valids)]
        with contextlib.ExitStack() as places:
            # Each further prompt is a request of its own on the workers: it holds a place
            # among max_concurrent_requests too (none free: the whole request is refused).
            timers = [timer, *(places.enter_context(self._relay.admitted()) for _ in valids[1:])]
            runs = PromptRuns(self._relay, valids, timers, buffered=not parsed.stream)
            if parsed.stream:
                return await self._stream(request, parsed, valids, runs, responses, echoes)
            return await self._complete(valids, runs, responses, echoes)

    def _echo_text(self, parsed: ParsedRequest, given: Prompt, valid: ValidRequest) -> str:
        """echo: the prompt as text (as given, or its token ids decoded); "" without echo."""
        if not parsed.echo:
            return ""
        return given if isinstance(given, str) else self._tokenizer.decode(valid.prompt_token_ids)

    def _prepare(self, kind: str, raw: bytes, request_id: str) -> tuple[ParsedRequest, list[ValidRequest]]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            raise invalid(None, "the request body is not valid JSON") from e
        parsed = parse_request(kind, body, self.model_names, request_id)
        return parsed, validated_all(parsed, self._tokenizer, self._limits)

    async def _complete(self, valids: list[ValidRequest], runs: PromptRuns, responses: Responses,
                        echoes: list[str]) -> web.Response:
        """The whole answer at once: one choice per prompt and completion, numbered
        prompt_index * n + completion index (vLLM's order)."""
        n = valids[0].params.n
        by_choice: dict[int, list[StreamDelta]] = {}
        async with runs:  # (leaving it early cancels the prompts still running)
            async for prompt_index, delta in runs:
                if delta.finish_reason == "abort":
                    raise _aborted(valids[prompt_index].request_id)
                by_choice.setdefault(prompt_index * n + delta.index, []).append(delta)
        choices = []
        for index in sorted(by_choice):
            whole = merged(by_choice[index])
            if whole.finish_reason not in ("stop", "length"):
                raise _aborted(valids[index // n].request_id)
            logprobs = responses.logprobs(index, whole.token_ids, whole.logprobs, whole.top_logprobs)
            choices.append(responses.choice(index, echoes[index // n] + whole.text, whole.finish_reason, logprobs))
        body = responses.response(choices, _usage(runs.finished))
        return web.json_response(body, dumps=_dumps, headers={"X-Request-Id": responses.id})

    async def _stream(self, request: web.Request, parsed: ParsedRequest, valids: list[ValidRequest],
                      runs: PromptRuns, responses: Responses, echoes: list[str]) -> web.StreamResponse:
        """Server-sent events, each delta as it comes (the prompts' interleaved, each choice
        numbered prompt_index * n + completion index). The response starts with the first
        delta, so a refusal before it (overloaded, no worker) still gets its HTTP status.
        echo: sent as each choice's first text."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", "X-Request-Id": responses.id})
        n = valids[0].params.n
        num_choices = n * len(valids)
        aborted = False

        async def write(*events: bytes) -> None:
            try:
                if not response.prepared:
                    await response.prepare(request)
                for event in events:
                    await response.write(event)
            except ConnectionResetError as e:  # aiohttp's word for a client gone away
                raise ClientGone() from e

        num_prompt_tokens = sum(len(valid.prompt_token_ids) for valid in valids)
        num_output_tokens = [0] * len(valids)  # by prompt (each delta counts all its completions)

        async def send(prompt_index: int, delta: StreamDelta) -> None:
            nonlocal aborted
            num_output_tokens[prompt_index] = delta.num_output_tokens
            if not response.prepared and parsed.kind == CHAT:
                await write(*(sse(responses.role_chunk(index)) for index in range(num_choices)))
            if not response.prepared and parsed.echo:
                await write(*(sse(responses.text_chunk(index, echoes[index // n], None))
                              for index in range(num_choices)))
            if aborted:
                return
            if delta.finish_reason == "abort":  # a success never ends "abort": the client gets an error
                aborted = True
                await write(sse(_aborted(valids[prompt_index].request_id).body()))
                return
            chunks = _chunks(responses, prompt_index * n + delta.index, delta)
            if parsed.continuous_usage:
                so_far = usage(num_prompt_tokens, sum(num_output_tokens))
                for chunk in chunks:
                    chunk["usage"] = so_far
            await write(*(sse(chunk) for chunk in chunks))

        # A client gone away surfaces as CancelledError (aiohttp cancels the handler) or
        # ClientGone (a write failed): each prompt's relay counts both as cancelled.
        try:
            try:
                async with runs:  # (leaving it early cancels the prompts still running)
                    async for prompt_index, delta in runs:
                        await send(prompt_index, delta)
                        if aborted:
                            break
            except ClientGone:
                raise
            except Exception as e:  # noqa: BLE001 - a relay's failure, or one in sending a chunk
                if not response.prepared:
                    raise
                failure = e if isinstance(e, RequestFailed) else failure_of(valids[0].request_id, e)
                # Too late for a status: OpenAI's client raises on an event carrying "error".
                await write(sse(_api_error(failure).body()))
                return response
            if not aborted:
                if parsed.include_usage:
                    await write(sse(responses.usage_chunk(_usage(runs.finished))))
                await write(DONE)
        except ClientGone:
            pass  # counted as cancelled; aiohttp finishes the response quietly
        return response


def _usage(finished: list[StreamDelta | None]) -> dict[str, int]:
    """Every prompt's tokens together (each last delta counts all its completions)."""
    done = [delta for delta in finished if delta is not None]
    return usage(sum(d.num_prompt_tokens for d in done), sum(d.num_output_tokens for d in done))


def _client_request_id(request: web.Request) -> str | None:
    given = request.headers.get("X-Request-Id")
    if given is None:
        return None
    try:
        return check_request_id(given, "X-Request-Id")
    except ValueError as e:
        raise invalid(None, str(e)) from None


def _chunks(responses: Responses, index: int, delta: StreamDelta) -> list[dict]:
    """A delta's stream chunks as choice ``index`` (none for a delta that holds text back and
    carries nothing else)."""
    logprobs = (responses.logprobs(index, delta.token_ids, delta.logprobs, delta.top_logprobs)
                if delta.token_ids else None)
    if responses.kind == CHAT:
        chunks = [responses.text_chunk(index, delta.text, logprobs)] if delta.text or logprobs else []
        if delta.finish_reason is not None:
            chunks.append(responses.finish_chunk(index, delta.finish_reason))
        return chunks
    if delta.text or logprobs or delta.finish_reason is not None:
        return [responses.text_chunk(index, delta.text, logprobs, delta.finish_reason)]
    return []


def _aborted(request_id: str) -> APIError:
    # Aborted on purpose (the gRPC Abort rpc by this id): running it again would undo that.
    return APIError(500, f"request {request_id} was aborted on the server", type="server_error",
                    code="request_aborted", headers={"x-should-retry": "false"})


def _api_error(failure: RequestFailed) -> APIError:
    """A failed request as OpenAI's error (a 429 says when to retry)."""
    status, kind, code = _HTTP_ERRORS.get(failure.code, (500, "server_error", None))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return APIError(status, failure.message, type=kind, code=code, headers=headers)


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
