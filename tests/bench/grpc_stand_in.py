"""A stand-in Generation service on a real gRPC server (loopback, any free port), for the
bench's load path without a cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from tandem.proto import generation_pb2_grpc as pb_grpc


@asynccontextmanager
async def grpc_server(servicer: pb_grpc.GenerationServicer) -> AsyncIterator[str]:
    """Serve ``servicer`` until the block ends -> its "host:port"."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
