"""API keys guarding the gRPC API (and the HTTP one): calls must carry
`authorization: Bearer <key>`. Each key names a tenant: a tenant's requests are its own (Abort
reaches no other tenant's).

Health checks stay open (load balancers and Kubernetes probes carry no token).
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import grpc

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "TANDEM_AUTH_TOKEN"
"""One key, of the tenant DEFAULT_TENANT."""
API_KEYS_ENV = "TANDEM_API_KEYS"
"""Several keys, each naming its tenant: ``tenant=key,tenant=key`` (with AUTH_TOKEN_ENV too)."""
ADMIN_API_KEY_ENV = "TANDEM_ADMIN_API_KEY"
"""The admin key: the only key the admin routes (draining, scaling) take."""
DEFAULT_TENANT = "default"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class ApiKeys:
    tenants: Mapping[str, str]
    """Each key -> the tenant it names."""

    def __post_init__(self) -> None:
        if not self.tenants or not all(k and t for k, t in self.tenants.items()):
            raise ValueError("API keys and their tenants must not be empty")

    @classmethod
    def of(cls, keys: str | ApiKeys | None) -> ApiKeys | None:
        """One key (str: of the default tenant), the keys themselves, or None (no auth)."""
        return keys if keys is None or isinstance(keys, ApiKeys) else cls({keys: DEFAULT_TENANT})

    @classmethod
    def parse(cls, text: str) -> dict[str, str]:
        """``tenant=key,tenant=key`` -> {key: tenant}."""
        tenants = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            tenant, sep, key = item.partition("=")
            if not sep or not tenant or not key:
                raise ValueError(f"${API_KEYS_ENV}: each entry is tenant=key, got {item.split('=')[0]!r}=...")
            tenants[key] = tenant
        return tenants

    def tenant_of(self, authorization: str | bytes) -> str | None:
        """The tenant whose key an ``authorization`` header carries (None: no valid key).
        Every key is compared, in constant time each."""
        found = None
        for key, tenant in self.tenants.items():
            if carries_key(authorization, key):
                found = tenant
        return found


def auth_token_from_env() -> str | None:
    """The token in $TANDEM_AUTH_TOKEN (None when unset or empty): what clients send."""
    return os.environ.get(AUTH_TOKEN_ENV) or None


def api_keys_from_env(api_key: str | None = None) -> ApiKeys | None:
    """The server's keys: ``api_key`` (``--api-key``) or else $TANDEM_AUTH_TOKEN, the default
    tenant's, and $TANDEM_API_KEYS."""
    tenants = ApiKeys.parse(os.environ.get(API_KEYS_ENV, ""))
    if token := api_key or auth_token_from_env():
        tenants[token] = DEFAULT_TENANT
    return ApiKeys(tenants) if tenants else None


def admin_key_from_env(admin_key: str | None = None, api_key: str | None = None) -> str | None:
    """The router's admin key: ``admin_key`` (``--admin-api-key``), else $TANDEM_ADMIN_API_KEY,
    else the operator's own API key (``api_key``: ``--api-key``, else $TANDEM_AUTH_TOKEN), never
    a tenant's key from $TANDEM_API_KEYS. None: no admin key."""
    return admin_key or os.environ.get(ADMIN_API_KEY_ENV) or api_key or auth_token_from_env()


def carries_key(authorization: str | bytes, key: str) -> bool:
    """Whether an ``authorization`` header carries ``key`` (compared in constant time)."""
    given = authorization.encode("utf-8", "surrogateescape") if isinstance(authorization, str) else authorization
    return hmac.compare_digest(given, f"Bearer {key}".encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if self._keys.tenant_of(given) is not None:
            return await continuation(handler_call_details)
        logger.warning("refused %s: %s", method, "no token" if not given else "wrong token")
        handler = await continuation(handler_call_details)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong 'authorization: Bearer <token>' metadata")

    async def refuse_stream(request, context: grpc.aio.ServicerContext):
        await refuse(request, context)
        yield  # pragma: no cover - never reached; makes this an async generator

    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                     handler.response_serializer)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, handler and handler.request_deserializer,
                                               handler and handler.response_serializer)
