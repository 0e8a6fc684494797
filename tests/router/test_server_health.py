"""Health follows the backend's readiness and turns NOT_SERVING on drain, liveness follows the
router alone; reflection lists the API."""

from __future__ import annotations

import asyncio

import grpc
from fake_backend import FakeBackend
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.router.server import LIVENESS_SERVICE, bound_port, drain, serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "tandem.v1.Generation")


async def statuses(stub: health_pb2_grpc.HealthStub) -> list[int]:
    return [(await stub.Check(health_pb2.HealthCheckRequest(service=s))).status for s in SERVICES]


async def wait_for_status(stub: health_pb2_grpc.HealthStub, status: int, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while await statuses(stub) != [status] * len(SERVICES):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def test_health_follows_readiness_and_drain(router_tokenizer):
    backend = FakeBackend(router_tokenizer, ready=False)

    async def body():
        server = await serve(backend, port=0, health_poll_s=0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{bound_port(server)}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            before = await statuses(stub)
            live = [(await stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))).status]
            backend.ready = True
            await wait_for_status(stub, SERVING)
            backend.ready = False  # a worker pool lost: health follows, liveness does not
            await wait_for_status(stub, NOT_SERVING)
            live.append((await stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))).status)
            backend.ready = True
            await wait_for_status(stub, SERVING)
            # Drain: a watcher sees NOT_SERVING before the server goes away.
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == SERVING
            draining = asyncio.create_task(drain(server, grace=1.0))
            after = (await asyncio.wait_for(watch.read(), 5)).status
            watch.cancel()
            await draining
            return before, after, live

    before, after, live = asyncio.run(body())
    assert before == [NOT_SERVING, NOT_SERVING] and live == [SERVING, SERVING]
    assert after == NOT_SERVING


def test_reflection_lists_and_describes_the_api(router_tokenizer):
    async def body():
        server = await serve(FakeBackend(router_tokenizer), port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bound_port(server)}") as channel:
                call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                listed = await call.read()
                await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.Generation"))
                described = await call.read()
                await call.done_writing()
                return listed, described
        finally:
            await drain(server, grace=0)

    listed, described = asyncio.run(body())
    names = {s.name for s in listed.list_services_response.service}
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    (api,) = [f for f in files if f.package == "tandem.v1"]
    assert {m.name for m in api.service[0].method} == {"Generate", "Abort"}
    assert "GenerateRequest" in {m.name for m in api.message_type}


def test_serve_refuses_a_busy_port(router_tokenizer):
    async def body():
        server = await serve(FakeBackend(router_tokenizer), port=0)
        port = bound_port(server)
        try:
            try:
                second = await serve(FakeBackend(router_tokenizer), port=port)
            except OSError:
                return True
            await drain(second, grace=0)
            return False
        finally:
            await drain(server, grace=0)

    assert asyncio.run(body()), "a second router on the same port must fail to start"
