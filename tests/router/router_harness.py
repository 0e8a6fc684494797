"""A real grpc.aio router on a free loopback port, for tests (over any Backend)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tandem.router.server import bound_port, drain, serve

MAX_MODEL_LEN = 256
"""Small, so that over-long prompts are cheap to build."""
VOCAB_SIZE = 49152


@contextlib.asynccontextmanager
async def serving(backend, **serve_args: Any) -> AsyncIterator[tuple[grpc.aio.Channel, grpc.aio.Server]]:
    """serve() on 127.0.0.1, port 0 -> (a grpc.aio channel to it, the server); drained after."""
    server = await serve(backend, port=0, health_poll_s=0.02, **serve_args)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{bound_port(server)}") as channel:
            yield channel, server
    finally:
        await drain(server, grace=0)


@contextlib.asynccontextmanager
async def running_router(backend) -> AsyncIterator[tuple[grpc.aio.Channel, int]]:
    """serving() -> (a grpc.aio channel to it, the port it got)."""
    async with serving(backend) as (channel, server):
        yield channel, bound_port(server)
