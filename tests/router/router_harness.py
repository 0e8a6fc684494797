"""A real grpc.aio router on a free loopback port, for tests (over any Backend)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from tandem.router.server import bound_port, drain, serve

MAX_MODEL_LEN = 256
"""Small, so that over-long prompts are cheap to build."""
VOCAB_SIZE = 49152


@contextlib.asynccontextmanager
async def running_router(backend) -> AsyncIterator[tuple[grpc.aio.Channel, int]]:
    """serve() on 127.0.0.1, port 0 -> (a grpc.aio channel to it, the port it got); drained after."""
    server = await serve(backend, port=0, health_poll_s=0.02)
    port = bound_port(server)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, port
    finally:
        await drain(server, grace=0)
