"""A shared token guarding the gRPC API: calls must carry `authorization: Bearer <token>`.

Health checks stay open (load balancers and Kubernetes probes carry no token).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Awaitable, Callable

import grpc

logger = logging.getLogger(__name__)

AUTH_TOKEN_ENV = "TANDEM_AUTH_TOKEN"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def auth_token_from_env() -> str | None:
    """The token in $TANDEM_AUTH_TOKEN (None when unset or empty)."""
    return os.environ.get(AUTH_TOKEN_ENV) or None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return await continuation(handler_call_details)
        logger.warning("refused %s: %s", method, "no token" if not given else "wrong token")
        handler = await continuation(handler_call_details)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>' metadata")

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
