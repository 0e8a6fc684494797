"""``tandem bench serve --api openai``: the HTTP driver against a tiny aiohttp server replaying
a fixed SSE stream, measured as the gRPC driver measures the same stream from a fake
grpc.aio servicer (no Ray, no model); HTTP errors recorded with their gRPC code names."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from grpc_stand_in import grpc_server

from tandem.bench import serve as bench_serve
from tandem.bench.serving import openai_api as serve_openai
from tandem.bench.serving.load import Request, RequestResult, greedy_request, run_load, summarize
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc

# (delay before it in s, text, token ids): an empty step first (held back: not the first
# token), then 3 chunks holding 4 tokens; the last one finishes with "length".
SCRIPT = [(0.06, "", []), (0.04, "Hel", [11]), (0.05, "lo wor", [12, 13]), (0.05, "ld", [14])]
TTFT_S, ITLS_S, TOKENS = 0.10, [0.05, 0.05], 4
REQUEST = Request(prompt_token_ids=[5, 6, 7], output_len=TOKENS, kind="short")
SLACK_MS = 400.0  # upper bound on scheduling noise; lower bounds are the scripted sleeps


class FakeGeneration(pb_grpc.GenerationServicer):
    """Replays SCRIPT as GenerateResponses, the last one with finish_reason LENGTH and usage."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.authorizations: list[str | None] = []

    async def Generate(self, request, context):  # noqa: N802 (the rpc's name)
        self.requests.append(request)
        self.authorizations.append(dict(context.invocation_metadata()).get("authorization"))
        for i, (delay, text, ids) in enumerate(SCRIPT):
            await asyncio.sleep(delay)
            last = i == len(SCRIPT) - 1
            yield pb.GenerateResponse(
                request_id=request.request_id, text=text, token_ids=ids,
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=TOKENS) if last else None)


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake-model",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": None}


class FakeOpenAI:
    """POST /v1/completions replaying SCRIPT as OpenAI chunks (usage chunk, then [DONE]), or
    with ``mode``: "429" a JSON rate-limit error, "midstream" an error event after the first
    chunk, "no-usage" no usage chunk; GET /v1/models lists "fake-model"."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.request_ids: list[str | None] = []
        self.authorizations: list[str | None] = []
        self.in_flight = self.most_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.paths.append(request.path)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        self.authorizations.append(request.headers.get("Authorization"))
        if self.mode == "429":
            return web.json_response({"error": {"message": "every worker's queue is full", "type": "rate_limit",
                                                "param": None, "code": 429}}, status=429)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n")
        for i, (delay, text, _) in enumerate(SCRIPT):
            await asyncio.sleep(delay)
            last = i == len(SCRIPT) - 1
            await response.write(_sse(_chunk(text, "length" if last else None)))
            if self.mode == "midstream" and text:
                await response.write(_sse({"error": {"message": "worker died", "type": "server_error",
                                                     "param": None, "code": "service_unavailable"}}))
                break
        if self.mode != "no-usage":
            await response.write(_sse({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                       "model": "fake-model", "choices": [],
                                       "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS,
                                                 "total_tokens": 3 + TOKENS}}))
        await response.write(_sse("[DONE]"))
        self.in_flight -= 1
        await response.write_eof()
        return response


@asynccontextmanager
async def http_server(fake: FakeOpenAI) -> AsyncIterator[str]:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _run(api: str, fake: FakeOpenAI | None = None, n: int = 1, servicer: FakeGeneration | None = None,
         **kw) -> list[RequestResult]:
    async def body() -> list[RequestResult]:
        server = grpc_server(servicer or FakeGeneration()) if api == "grpc" else http_server(fake or FakeOpenAI())
        async with server as target:
            results, _ = await run_load(target, [REQUEST] * n, [0.0] * n, tag="t", desc="t", timeout=30,
                                        progress=False, api=api, **kw)
            return results

    return asyncio.run(body())


def _check_timings(r: RequestResult) -> None:
    assert r.ttft_ms is not None and r.e2el_ms is not None
    assert TTFT_S * 1e3 <= r.ttft_ms < TTFT_S * 1e3 + SLACK_MS
    assert len(r.itl_ms) == len(ITLS_S) == r.num_chunks - 1
    for got, scripted in zip(r.itl_ms, ITLS_S):
        assert scripted * 1e3 * 0.9 <= got < scripted * 1e3 + SLACK_MS
    assert r.e2el_ms >= r.ttft_ms + sum(r.itl_ms) - 1e-6
    assert r.tpot_ms == pytest.approx((r.e2el_ms - r.ttft_ms) / (TOKENS - 1))


def test_openai_driver_measures_as_the_grpc_one():
    fake = FakeOpenAI()
    (http,) = _run("openai", fake)
    (rpc,) = _run("grpc")
    for r in (http, rpc):
        assert r.success and r.code == "OK" and r.error is None and r.finish_reason == "length"
        assert r.output_tokens == r.usage_completion_tokens == TOKENS == r.requested_output_len
        assert r.num_chunks == 3 and r.prompt_len == 3 and r.kind == "short"
        _check_timings(r)
    same = ("success", "code", "error", "finish_reason", "output_tokens", "usage_completion_tokens", "num_chunks",
            "index", "kind", "prompt_len", "requested_output_len")
    assert {k: getattr(http, k) for k in same} == {k: getattr(rpc, k) for k in same}
    # The gRPC call's twin: token ids as the prompt, the same greedy sampling, streamed with usage.
    (body,) = fake.bodies
    assert fake.paths == ["/v1/completions"] and fake.request_ids == ["t-0"]
    assert body == {"model": "fake-model", "prompt": [5, 6, 7], "max_tokens": TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def test_http_errors_are_recorded_as_grpc_codes():
    (refused,) = _run("openai", FakeOpenAI("429"), model="named")
    assert not refused.success and refused.code == "RESOURCE_EXHAUSTED" and refused.ttft_ms is None
    assert refused.error == "RESOURCE_EXHAUSTED: HTTP 429: every worker's queue is full"
    assert refused.e2el_ms is not None and refused.e2el_ms > 0 and refused.output_tokens == 0
    m = summarize([refused], 1.0, {})
    assert m["completed"] == 0 and m["failed"] == 1

    (broken,) = _run("openai", FakeOpenAI("midstream"))
    assert not broken.success and broken.code == "UNAVAILABLE" and broken.error == "UNAVAILABLE: worker died"
    (no_usage,) = _run("openai", FakeOpenAI("no-usage"))
    assert not no_usage.success and no_usage.code == "OK" and no_usage.error is not None and "usage" in no_usage.error

    async def closed_port() -> RequestResult:
        async with serve_openai.openai_client("127.0.0.1:1", timeout=5, connections=1, model="m") as send:
            return await send(REQUEST, 0, "x")

    down = asyncio.run(closed_port())
    assert not down.success and down.code == "UNAVAILABLE" and (down.error or "").startswith("UNAVAILABLE: ")


def test_one_session_with_enough_connections(monkeypatch: pytest.MonkeyPatch):
    limits: list[int] = []
    connector: Callable[..., aiohttp.TCPConnector] = aiohttp.TCPConnector

    def recording(*args, **kwargs) -> aiohttp.TCPConnector:
        limits.append(kwargs["limit"])
        return connector(*args, **kwargs)

    monkeypatch.setattr(serve_openai.aiohttp, "TCPConnector", recording)
    fake = FakeOpenAI()
    results = _run("openai", fake, n=4, max_concurrency=4)
    assert all(r.success for r in results) and fake.most_in_flight == 4
    assert limits == [4]  # one session (one connector) for the run, room for every call in flight
    assert sorted(str(i) for i in fake.request_ids) == [f"t-{i}" for i in range(4)]


def test_request_body_follows_the_grpc_input():
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                              sampling=pb.SamplingParams(temperature=0.7, seed=3, max_tokens=5, stop=["\n"],
                                                         logprobs=3))
    path, body = serve_openai.request_body(chat, "m")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["temperature"], body["seed"], body["max_tokens"], body["stop"], body["logprobs"],
            body["top_logprobs"]) == (0.7, 3, 5, ["\n"], True, 3)
    path, body = serve_openai.request_body(pb.GenerateRequest(prompt="Once", sampling=pb.SamplingParams(
        logprobs=0)), "m")
    assert path == "/v1/completions" and body["prompt"] == "Once" and body["logprobs"] == 0
    path, body = serve_openai.request_body(greedy_request("r", [1, 2], 7), "m")
    assert path == "/v1/completions" and body["prompt"] == [1, 2] and "seed" not in body
    assert serve_openai.base_url("h:1") == "http://h:1" and serve_openai.base_url("https://h/") == "https://h"
    assert serve_openai.error_code({"code": "resource_exhausted"}, 500) == "RESOURCE_EXHAUSTED"
    assert serve_openai.error_code({"code": 503}, None) == "UNAVAILABLE"
    assert serve_openai.error_code({"type": "server_error", "code": None}, None) == "INTERNAL"
    assert serve_openai.error_code({"type": "server_error", "code": None}, 503) == "UNAVAILABLE"
    assert serve_openai.error_code(None, 418) == "UNKNOWN"


def test_openai_api_needs_a_server():
    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    assert parser.parse_args([]).api == "grpc"
    with pytest.raises(ValueError, match="--api openai needs --server"):
        bench_serve.settings_from_args(parser.parse_args(["--api", "openai"]))
    bench_serve.settings_from_args(parser.parse_args(["--api", "openai", "--server", "127.0.0.1:8000"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--api", "rest"])


def test_both_drivers_send_the_api_key(monkeypatch: pytest.MonkeyPatch):
    """`tandem bench serve --api-key` (or $TANDEM_AUTH_TOKEN): every call carries it."""
    monkeypatch.setenv("TANDEM_AUTH_TOKEN", "k3y")
    fake, servicer = FakeOpenAI(), FakeGeneration()
    assert all(r.success for r in _run("openai", fake, n=2) + _run("grpc", servicer=servicer, n=2))
    assert fake.authorizations == ["Bearer k3y"] * 3  # GET /v1/models, then each call
    assert servicer.authorizations == ["Bearer k3y"] * 2
