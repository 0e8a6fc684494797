"""vLLM's routes beside the OpenAI ones: /tokenize, /detokenize (vLLM's request and response
shapes), /version, and /metrics on the API port (the router's and every worker's, as on the
metrics port: at most MAX_SCRAPES at once; the metrics token when one is set, else the API key)."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tandem.router.limits import RequestLimits
from tandem.router.metrics_endpoint import MAX_SCRAPES
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.fields import boolean, json_kind
from tandem.router.openai.protocol import CHAT, parse_request
from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer
from tandem.router.validation import ValidRequest, validate_request

METRICS_PATH = "/metrics"
"""Guarded by the metrics token when one is set (then no API key is asked), else by the API key."""


def add_utility_routes(app: web.Application, tokenizer: RouterTokenizer, limits: RequestLimits,
                       model_names: tuple[str, ...], registry: CollectorRegistry, metrics_token: str | None) -> None:
    scrapes = asyncio.Semaphore(MAX_SCRAPES)
    expected = None if metrics_token is None else f"Bearer {metrics_token}"

    async def tokenize(request: web.Request) -> web.Response:
        body = await json_body(request)
        if "messages" in body:
            tokens = _chat_tokens(body, tokenizer, limits, model_names)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise invalid("prompt", f"must be a string, got {json_kind(prompt)}")
            if len(prompt) > limits.max_prompt_chars:
                raise invalid("prompt", f"{len(prompt)} characters, more than the limit "
                                        f"max_prompt_chars={limits.max_prompt_chars}")
            tokens = tokenizer.encode(prompt, boolean("add_special_tokens", body.get("add_special_tokens", True)))
        return web.json_response({"count": len(tokens), "max_model_len": tokenizer.max_model_len, "tokens": tokens,
                                  "token_strs": None})

    async def detokenize(request: web.Request) -> web.Response:
        body = await json_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < tokenizer.vocab_size for t in tokens):
            raise invalid("tokens", f"must be an array of token ids in [0, {tokenizer.vocab_size})")
        # As vLLM's (transformers' decode default): special tokens are kept.
        return web.json_response({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": importlib.metadata.version("tandem")})

    async def metrics(request: web.Request) -> web.Response:
        if expected is not None and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                                            expected.encode()):
            raise APIError(401, "a metrics token is required: Authorization: Bearer <token>", code="invalid_api_key")
        if scrapes.locked():
            raise APIError(503, f"{MAX_SCRAPES} scrapes are in progress: retry later", type="server_error")
        async with scrapes:
            # Off the loop: a scrape asks every worker, through this very loop.
            text = await asyncio.to_thread(generate_latest, registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get(METRICS_PATH, metrics)


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise invalid(None, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {json_kind(body)}")
    return body


def _chat_tokens(body: dict[str, Any], tokenizer: RouterTokenizer, limits: RequestLimits,
                 model_names: tuple[str, ...]) -> list[int]:
    """The prompt ids a chat request with these messages would have (the chat route's own checks)."""
    parsed = parse_request(CHAT, {key: body.get(key) for key in ("model", "messages", "chat_template_kwargs")},
                           model_names, "t")
    try:
        valid: ValidRequest = validate_request(parsed.request, tokenizer, limits, parsed.chat_template_kwargs)
    except (ValueError, ChatTemplateError) as e:
        raise invalid("messages", str(e).partition(": ")[2] or str(e)) from e
    return valid.prompt_token_ids
