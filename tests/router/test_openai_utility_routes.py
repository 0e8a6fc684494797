"""vLLM's routes on the API port: /tokenize and /detokenize (checked against transformers'
tokenizer), /version, /metrics (its own token, not the API key), and X-Request-Id honoured."""

from __future__ import annotations

import asyncio
import importlib.metadata

import aiohttp
import openai
from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving

from tandem.router.auth import ApiKeys
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.openai.app import start_openai_endpoint

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def run(backend, calls, **serving):
    async def body():
        async with openai_serving(backend, **serving) as served, aiohttp.ClientSession() as session:
            return await calls(served, session)

    return asyncio.run(body())


def test_tokenize_and_detokenize_are_transformers(router_tokenizer, tokenizer):
    text = "Hello world, tokenize me."

    async def calls(served, session):
        answers = []
        for body in ({"model": MODEL, "prompt": text}, {"prompt": text, "add_special_tokens": False},
                     {"model": MODEL, "messages": MESSAGES}):
            async with session.post(f"{served.root}/tokenize", json=body) as r:
                answers.append((r.status, await r.json()))
        ids = tokenizer.encode(text)
        async with session.post(f"{served.root}/detokenize", json={"tokens": ids}) as r:
            answers.append((r.status, await r.json()))
        async with session.post(f"{served.root}/detokenize", json={"tokens": [-1]}) as r:
            answers.append((r.status, await r.json()))
        return answers

    (s1, plain), (s2, bare), (s3, chat), (s4, back), (s5, bad) = run(FakeBackend(router_tokenizer), calls)
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 200, 400)
    assert plain["tokens"] == tokenizer.encode(text) and plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == router_tokenizer.max_model_len
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert back["prompt"] == tokenizer.decode(tokenizer.encode(text))
    assert bad["error"]["param"] == "tokens"


def test_version_and_metrics_on_the_api_port(router_tokenizer):
    """With API keys on, /metrics needs the metrics token, not a key; /version needs a key."""
    backend = FakeBackend(router_tokenizer)

    async def body():
        metrics = RouterMetrics(MODEL, router_tokenizer.max_model_len)
        endpoint = await start_openai_endpoint(backend, router_tokenizer, metrics, RequestLimits(), "127.0.0.1", 0,
                                               ApiKeys({"key": "acme"}), grace_s=0.5, metrics_token="scrape")
        root = f"http://127.0.0.1:{endpoint.port}"
        try:
            async with aiohttp.ClientSession() as session:
                statuses = {}
                for name, path, headers in (("version", "/version", {"Authorization": "Bearer key"}),
                                            ("version without key", "/version", {}),
                                            ("metrics", "/metrics", {"Authorization": "Bearer scrape"}),
                                            ("metrics without token", "/metrics", {"Authorization": "Bearer key"})):
                    async with session.get(root + path, headers=headers) as r:
                        statuses[name] = (r.status, await r.text())
                return statuses
        finally:
            await endpoint.stop()

    statuses = asyncio.run(body())
    without_token = asyncio.run(metrics_status(router_tokenizer, backend))
    assert statuses["version"][0] == 200
    assert statuses["version"][1] == '{"version": "%s"}' % importlib.metadata.version("tandem")
    assert statuses["version without key"][0] == 401
    assert statuses["metrics"][0] == 200 and "tandem_request_success_total" in statuses["metrics"][1]
    assert statuses["metrics without token"][0] == 401
    # No metrics token: the API key guards /metrics like the other routes.
    assert without_token == {"no key": 401, "key": 200}


async def metrics_status(router_tokenizer, backend) -> dict[str, int]:
    metrics = RouterMetrics(MODEL, router_tokenizer.max_model_len)
    endpoint = await start_openai_endpoint(backend, router_tokenizer, metrics, RequestLimits(), "127.0.0.1", 0,
                                           ApiKeys({"key": "acme"}), grace_s=0.5)
    try:
        async with aiohttp.ClientSession() as session:
            found = {}
            for name, headers in (("no key", {}), ("key", {"Authorization": "Bearer key"})):
                async with session.get(f"http://127.0.0.1:{endpoint.port}/metrics", headers=headers) as r:
                    found[name] = r.status
            return found
    finally:
        await endpoint.stop()


def test_x_request_id_names_the_response(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def calls(served, session):
        client = served.async_client()
        whole = await client.completions.with_raw_response.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "trace-123"})
        stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                                 extra_headers={"X-Request-Id": "trace-456"})
        ids = {c.id async for c in stream}
        try:
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                            extra_headers={"X-Request-Id": "bad id!"})
        except openai.BadRequestError as e:
            refused = e.status_code
        await client.close()
        return whole.headers["X-Request-Id"], whole.parse().id, ids, refused

    header, response_id, stream_ids, refused = run(backend, calls)
    assert header == response_id == "trace-123" and stream_ids == {"trace-456"} and refused == 400
    assert len({s.request_id for s in backend.seen}) == 2 and "trace-123" not in {s.request_id for s in backend.seen}
