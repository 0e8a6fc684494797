"""Property-based fuzzing of the gRPC API: 500 hostile GenerateRequests (huge and negative
numbers, NaN/inf, empty and enormous prompts, thousands of stop strings, out-of-vocabulary
ids, weird request ids and chat roles, unicode edge cases) through one real grpc.aio router
over the fake backend. Every call ends OK or INVALID_ARGUMENT naming the field, never
INTERNAL or UNKNOWN, and the router stays healthy and holds no stream afterwards."""

from __future__ import annotations

import asyncio
import collections
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings

from fake_backend import FakeBackend
from fuzz_requests import check_outcome, generate_requests
from router_harness import MAX_MODEL_LEN, VOCAB_SIZE
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.server import bound_port, drain, serve

NUM_EXAMPLES = 500


class Router:
    """One router for every example: its event loop runs on a thread of its own."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fuzz-router")
        self.thread.start()
        self.server = self.run(serve(backend, port=0, health_poll_s=0.02))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{bound_port(self.server)}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.refused_fields: collections.Counter[str] = collections.Counter()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        self.channel.close()
        self.run(drain(self.server, grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def router(router_tokenizer):
    router = Router(FakeBackend(router_tokenizer))
    yield router
    router.close()


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(req=generate_requests(MAX_MODEL_LEN, VOCAB_SIZE))
def test_hostile_requests_get_a_clear_status(router, req):
    responses: list[pb.GenerateResponse] = []
    error = None
    try:
        responses.extend(router.stub.Generate(req, timeout=30))
    except grpc.RpcError as e:
        error = e
    router.outcomes[check_outcome(req, responses, error)] += 1
    if error is not None:
        router.refused_fields[error.details().split(":", 1)[0]] += 1


def test_router_healthy_and_idle_after_the_fuzz(router):
    # Runs after the fuzz test (file order), on the same router.
    print("fuzz outcomes:", dict(router.outcomes), "refused fields:", dict(router.refused_fields.most_common()))
    assert sum(router.outcomes.values()) >= NUM_EXAMPLES
    assert router.outcomes["OK"] >= 10 and router.outcomes["INVALID_ARGUMENT"] >= 100, router.outcomes
    health = health_pb2_grpc.HealthStub(router.channel).Check(
        health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    backend = router.backend
    assert not backend.running and not backend.closed_early, (backend.running, backend.closed_early)
    ok = list(router.stub.Generate(pb.GenerateRequest(prompt="Still there?", sampling=pb.SamplingParams(max_tokens=3)),
                                   timeout=30))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH and ok[-1].usage.completion_tokens == 3
