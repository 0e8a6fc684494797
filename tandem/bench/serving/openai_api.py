"""The OpenAI-compatible HTTP driver of ``tandem bench serve --api openai``: each request is
the gRPC call's twin, streamed with server-sent events, measured as the gRPC path measures.

The body comes from the very ``GenerateRequest`` the gRPC driver sends, so both APIs get the
same prompt and sampling: token ids go to ``POST /v1/completions`` with ``prompt`` as a list
of ints, plain text too (as a string), chat messages to ``POST /v1/chat/completions``; the
sampling fields keep their names (``ignore_eos``, ``top_k``, ... as extra body fields, as
vLLM's server takes them), and ``stream_options.include_usage`` is set. TTFT is the first
chunk with non-empty content, ITL the gaps between such chunks, the completion tokens those
of the usage chunk; an HTTP error is recorded with its status's gRPC code name."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc

from tandem.bench.serving.load import Request, RequestResult, Send, conclude, greedy_request
from tandem.proto import generation_pb2 as pb
from tandem.router.auth import auth_token_from_env

HTTP_TO_GRPC = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED", 409: "ABORTED", 413: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
    502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}
"""An HTTP error status -> the gRPC code the router would have answered (grpc-gateway's
mapping, reversed), so ``RequestResult.code`` reads the same for both APIs; others UNKNOWN."""
OPENAI_TO_GRPC = {
    "rate_limit_exceeded": "RESOURCE_EXHAUSTED", "rate_limit_error": "RESOURCE_EXHAUSTED",
    "service_unavailable": "UNAVAILABLE", "request_aborted": "ABORTED", "model_not_found": "NOT_FOUND",
    "invalid_request_error": "INVALID_ARGUMENT", "server_error": "INTERNAL",
}
"""An error event's OpenAI ``code`` or ``type`` -> its gRPC code, for errors sent mid-stream
(after the 200, so without a status of their own)."""
GRPC_CODES = frozenset(code.name for code in grpc.StatusCode)


def base_url(target: str) -> str:
    """``HOST:PORT`` (or a URL already) -> the server's base URL, without a trailing slash."""
    url = target if target.startswith(("http://", "https://")) else f"http://{target}"
    return url.rstrip("/")


def request_body(request: pb.GenerateRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The HTTP twin of a gRPC ``GenerateRequest`` -> (path, JSON body), streamed with usage."""
    sampling: dict[str, Any] = {}
    for fd, value in request.sampling.ListFields():
        sampling[fd.name] = list(value) if fd.is_repeated else value
    which = request.WhichOneof("input")
    if which == "messages":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": m.role, "content": m.content}
                                             for m in request.messages.messages]}
    elif which == "token_ids":
        path, body = "/v1/completions", {"prompt": list(request.token_ids.ids)}
    elif which == "prompt":
        path, body = "/v1/completions", {"prompt": request.prompt}
    else:
        raise ValueError("the request has no input")
    if "logprobs" in sampling:  # chat asks with a flag and top_logprobs, completions with the count
        count = sampling.pop("logprobs")
        sampling.update({"logprobs": True, "top_logprobs": count} if which == "messages" else {"logprobs": count})
    return path, {"model": model, **body, **sampling, "stream": True, "stream_options": {"include_usage": True}}


def error_code(error: Any, status: int | None) -> str:
    """The gRPC code name of an OpenAI error object answered with HTTP ``status`` (None for an
    event mid-stream): its ``code`` when that names a gRPC code or an HTTP status, else the
    status's, else its ``code``'s or ``type``'s (OPENAI_TO_GRPC), else UNKNOWN."""
    error = error if isinstance(error, dict) else {}
    code = error.get("code")
    if isinstance(code, str) and code.upper() in GRPC_CODES:
        return code.upper()
    if isinstance(code, int) and not isinstance(code, bool) and code in HTTP_TO_GRPC:
        return HTTP_TO_GRPC[code]
    if status is not None:
        return HTTP_TO_GRPC.get(status, "UNKNOWN")
    for key in (code, error.get("type")):
        if isinstance(key, str) and key in OPENAI_TO_GRPC:
            return OPENAI_TO_GRPC[key]
    return "UNKNOWN"


def error_message(error: Any, fallback: str) -> str:
    """An OpenAI error object's message (``{"message": ...}``), else ``fallback``."""
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return fallback


def _fail(result: RequestResult, code: str, details: str) -> None:
    result.code, result.error = code, f"{code}: {details}"


async def _error_response(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    """Record a non-200 response: its status as a gRPC code, the OpenAI error's message."""
    text = await response.text(errors="replace")
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    message = error_message(error, text.strip()[:500] or response.reason or "")
    _fail(result, error_code(error, response.status), f"HTTP {response.status}: {message}")


def _on_chunk(chunk: dict, result: RequestResult) -> bool:
    """Fold one chunk's finish reason, usage or in-stream error into ``result``
    -> whether it carried content (non-empty text or delta content)."""
    if chunk.get("error") is not None:
        error = chunk["error"]
        _fail(result, error_code(error, None), error_message(error, json.dumps(error)))
        return False
    content = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = content or bool(choice.get("text") or delta.get("content"))
        if choice.get("finish_reason") is not None:
            result.finish_reason = str(choice["finish_reason"])
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.usage_completion_tokens = result.output_tokens = usage["completion_tokens"]
    return content


async def send_one_http(session: aiohttp.ClientSession, url: str, model: str, request: Request, index: int,
                        request_id: str, timeout: float | None) -> RequestResult:
    """One streamed request (the twin of ``serve_load.send_one``) -> its result."""
    result = RequestResult(index, request.kind, len(request.prompt_token_ids), request.output_len)
    path, body = request_body(greedy_request(request_id, request.prompt_token_ids, request.output_len), model)
    start = last = time.perf_counter()
    try:
        async with session.post(url + path, json=body, headers={"X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                await _error_response(response, result)
                return conclude(result, start)
            async for raw in response.content:
                now = time.perf_counter()
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, event: / id: fields
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    chunk = None
                if not isinstance(chunk, dict):
                    _fail(result, "INTERNAL", f"malformed server-sent event: {data[:200]!r}")
                    break
                if _on_chunk(chunk, result):
                    if result.ttft_ms is None:
                        result.ttft_ms = (now - start) * 1e3
                    else:
                        result.itl_ms.append((now - last) * 1e3)
                    last = now
                    result.num_chunks += 1
                if result.error is not None:
                    break
        if result.error is None:
            result.code = "OK"
            if result.finish_reason in ("stop", "length") and result.usage_completion_tokens is None:
                result.error = "stream ended without a usage chunk (stream_options.include_usage)"
    except TimeoutError:
        _fail(result, "DEADLINE_EXCEEDED", f"no complete response within {timeout} s")
    except aiohttp.ClientError as e:
        _fail(result, "UNAVAILABLE", f"{type(e).__name__}: {e}")
    return conclude(result, start)


async def served_model(target: str) -> str:
    """The id of the first model ``GET /v1/models`` lists at ``target`` (what bodies name)."""
    token = auth_token_from_env()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"} if token else None) as session:
        return await _served_model(session, base_url(target))


async def _served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {url}/v1/models: HTTP {response.status}: {await response.text()}")
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"GET {url}/v1/models lists no model")
    return str(models[0]["id"])


@asynccontextmanager
async def openai_client(target: str, *, timeout: float | None, connections: int,
                        model: str | None = None) -> AsyncIterator[Send]:
    """One ``aiohttp.ClientSession`` for the run, at most ``connections`` connections (at least
    the calls in flight at once, so none waits for a connection); ``model``: the body's model,
    by default the first the server lists."""
    url = base_url(target)
    connector = aiohttp.TCPConnector(limit=max(1, connections))
    token = auth_token_from_env()  # the router's API key, when it wants one
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout),
                                     headers=headers) as session:
        name = model or await _served_model(session, url)
        yield lambda request, index, request_id: send_one_http(session, url, name, request, index, request_id,
                                                               timeout)
