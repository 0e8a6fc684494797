"""The OpenAI-compatible HTTP API: an aiohttp application on the router's own event loop.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events or not), ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``. With an
auth token every route but ``/health`` needs ``Authorization: Bearer <token>``. Errors
come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, aiohttp's own
(unknown route, wrong method) included.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from tandem.router.auth import ApiKeys, carries_key
from tandem.router.backend import Backend
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.openai.admin_routes import ADMIN_PREFIX, add_admin_routes
from tandem.router.openai.errors import APIError
from tandem.router.openai.generation import TENANT_KEY, Generation
from tandem.router.openai.protocol import CHAT, COMPLETION
from tandem.router.openai.responses import model_card, models_list
from tandem.router.openai.utility_routes import METRICS_PATH, add_utility_routes
from tandem.router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)
"""What needs no API key (load balancers and Kubernetes probes carry none); so does /metrics
when a metrics token guards it instead."""
STOP_GRACE_S = 5.0
"""How long stop() lets running requests finish before cancelling them."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OpenAIEndpoint:
    """A started OpenAI-compatible API (from start_openai_endpoint)."""

    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self._runner = runner
        self.port = port
        """The port it listens on (what port 0 became)."""

    async def stop(self) -> None:
        """Stop listening, let running requests finish (up to the grace given at start),
        then cancel the rest: a cancelled request is aborted on the workers."""
        await self._runner.cleanup()
        logger.info("OpenAI-compatible API on port %d stopped", self.port)


async def start_openai_endpoint(backend: Backend, tokenizer: RouterTokenizer, metrics: RouterMetrics,
                                limits: RequestLimits, host: str, port: int,
                                auth_token: str | ApiKeys | None = None, *, grace_s: float = STOP_GRACE_S,
                                ssl_context: ssl.SSLContext | None = None,
                                model_names: Sequence[str] | None = None,
                                metrics_token: str | None = None, admin_key: str | None = None) -> OpenAIEndpoint:
    """Serve the OpenAI-compatible API on host:port (0: a free port) on the running loop.

    Requests share the gRPC API's admission bound (``metrics.num_running`` against
    ``limits.max_concurrent_requests``), validation and request metrics. auth_token: the
    ``Authorization: Bearer`` key (or one of the keys) every route but /health needs (None: open). grace_s:
    how long stop() waits for running requests. ssl_context: HTTPS (None: HTTP). model_names:
    the names requests may give as ``model`` (the first is reported; default: the tokenizer's
    model name). metrics_token: what /metrics scrapes must carry (None: open). admin_key: the
    only key the admin routes take (None: they take none, and are open only where no key is
    set at all). A busy port raises OSError.
    """
    if auth_token is not None and not auth_token:
        raise ValueError("the auth token must not be empty")
    generation = Generation(backend, tokenizer, metrics, limits, model_names)
    open_paths = OPEN_PATHS + ((METRICS_PATH,) if metrics_token else ())
    app = _application(generation, backend, ApiKeys.of(auth_token), admin_key, limits.max_body_bytes, open_paths)
    add_utility_routes(app, tokenizer, limits, generation.model_names, metrics.registry, metrics_token)
    add_admin_routes(app, getattr(backend, "pool_changes", None))
    # handler_cancellation: a client that disconnects cancels its handler at once, wherever
    # it waits (the admission queue, the workers), and the cancel aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot serve the OpenAI-compatible API on {host}:{port}: {e}") from e
    bound = runner.addresses[0][1]
    logger.info("OpenAI-compatible API on http://%s:%d/v1 (model %s%s)", host, bound, generation.model,
                ", token required" if auth_token else "")
    return OpenAIEndpoint(runner, bound)


def _application(generation: Generation, backend: Backend, keys: ApiKeys | None, admin_key: str | None,
                 client_max_size: int, open_paths: tuple[str, ...]) -> web.Application:
    middlewares: list[Middleware] = [_errors, _admin_auth(admin_key, keys)]
    if keys:
        middlewares.append(_auth(keys, open_paths))
    app = web.Application(middlewares=middlewares, client_max_size=client_max_size)
    created = int(time.time())
    names = generation.model_names

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generation.handle(COMPLETION, request)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await generation.handle(CHAT, request)

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response(models_list(names, created))

    async def get_model(request: web.Request) -> web.Response:
        if request.match_info["model"] not in names:
            raise APIError(404, f"The model {request.match_info['model'][:100]!r} does not exist: this server "
                                f"serves {names[0]!r}", param="model", code="model_not_found")
        return web.json_response(model_card(request.match_info["model"], created))

    async def health(request: web.Request) -> web.Response:
        try:
            ready = bool(backend.is_ready())
        except Exception:  # noqa: BLE001 - a failing readiness check means not ready
            logger.exception("backend.is_ready() failed")
            ready = False
        return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    return app


def _error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """APIError, and aiohttp's own HTTP errors, as OpenAI's error JSON."""
    try:
        return await handler(request)
    except APIError as e:
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return _error_response(APIError(e.status, f"{request.method} {request.path[:200]}: {e.reason}", type=kind,
                                        headers=headers))


def _auth(keys: ApiKeys, open_paths: tuple[str, ...]) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths or request.path.startswith(ADMIN_PREFIX):  # (those: _admin_auth's)
            return await handler(request)
        given = request.headers.get("Authorization", "")
        tenant = keys.tenant_of(given)
        if tenant is not None:
            request[TENANT_KEY] = tenant  # whose prefix cache its requests use (tenant_cache.py)
            return await handler(request)
        logger.warning("refused %s %s: %s", request.method, request.path[:200],
                       "no token" if not given else "wrong token")
        raise APIError(401, "Incorrect API key provided: send 'Authorization: Bearer <token>' with the server's token",
                       code="invalid_api_key")

    return auth


def _admin_auth(admin_key: str | None, keys: ApiKeys | None) -> Middleware:
    """The admin routes take only the admin key; with no key set at all (a router on loopback
    for one user), they are as open as every other route."""
    @web.middleware
    async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(ADMIN_PREFIX) or (admin_key is None and keys is None):
            return await handler(request)
        given = request.headers.get("Authorization", "")
        if admin_key is not None and carries_key(given, admin_key):
            return await handler(request)
        logger.warning("refused %s %s: %s", request.method, request.path[:200],
                       "no admin key set" if admin_key is None else "not the admin key")
        if admin_key is None:
            raise APIError(403, "the admin routes are off: start the router with --admin-api-key to use them",
                           code="admin_key_not_set")
        if keys is not None and keys.tenant_of(given) is not None:
            raise APIError(403, "this API key may not change the cluster's workers: send the admin key",
                           code="not_admin_key")
        raise APIError(401, "Incorrect admin key provided: send 'Authorization: Bearer <admin key>'",
                       code="invalid_api_key")

    return admin_auth
