"""Property-based fuzzing of the gRPC API: 500 hostile GenerateRequests (huge and negative
numbers, NaN/inf, empty and enormous prompts, thousands of stop strings, out-of-vocabulary
ids, weird request ids and chat roles, unicode edge cases) through one real grpc.aio router
over the fake backend. Every call ends OK or INVALID_ARGUMENT naming the field, never
INTERNAL or UNKNOWN, and the router stays healthy and holds no stream afterwards. Then 200
raw byte strings (valid requests with bytes flipped, cut or spliced with invalid UTF-8, and
random bytes) meet the same rule."""

from __future__ import annotations

import asyncio
import collections
import threading

import grpc
import pytest
from fake_backend import FakeBackend
from fuzz_requests import check_outcome, generate_requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_harness import MAX_MODEL_LEN, VOCAB_SIZE

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.server import bound_port, drain, serve

NUM_EXAMPLES = 500
NUM_RAW_EXAMPLES = 200
BAD_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80"]


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


@st.composite
def raw_requests(draw) -> bytes:
    """Bytes on the wire that protobuf may or may not parse as a GenerateRequest."""
    valid = draw(generate_requests(MAX_MODEL_LEN, VOCAB_SIZE, cheap=True)).SerializeToString()
    kind = draw(st.sampled_from(["flip", "cut", "utf8", "random"]))
    if kind == "random" or not valid:
        return draw(st.binary(max_size=300))
    at = draw(st.integers(0, len(valid) - 1))
    if kind == "flip":
        return valid[:at] + bytes([valid[at] ^ draw(st.integers(1, 255))]) + valid[at + 1:]
    if kind == "cut":
        return valid[:at]
    return valid[:at] + draw(st.sampled_from(BAD_UTF8)) + valid[at:]


@settings(max_examples=NUM_RAW_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=raw_requests())
def test_hostile_bytes_get_a_clear_status(router, data):
    generate = router.channel.unary_stream("/tandem.v1.Generation/Generate", request_serializer=lambda b: b,
                                           response_deserializer=pb.GenerateResponse.FromString)
    responses: list[pb.GenerateResponse] = []
    error = None
    try:
        responses.extend(generate(data, timeout=30))
    except grpc.RpcError as e:
        error = e
    try:
        parsed = pb.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf refused it: the router must have too
        assert error is not None and error.details().startswith("request: not a valid "), error
        parsed = pb.GenerateRequest()
    router.outcomes[check_outcome(parsed, responses, error)] += 1
    if error is not None:
        router.refused_fields[error.details().split(":", 1)[0]] += 1


def test_router_healthy_and_idle_after_the_fuzz(router, fault_report):
    # Runs after the fuzz test (file order), on the same router.
    print("fuzz outcomes:", dict(router.outcomes), "refused fields:", dict(router.refused_fields.most_common()))
    assert sum(router.outcomes.values()) >= NUM_EXAMPLES + NUM_RAW_EXAMPLES
    assert router.outcomes["OK"] >= 10 and router.outcomes["INVALID_ARGUMENT"] >= 100, router.outcomes
    health = health_pb2_grpc.HealthStub(router.channel).Check(
        health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    backend = router.backend
    assert not backend.running and not backend.closed_early, (backend.running, backend.closed_early)
    ok = list(router.stub.Generate(pb.GenerateRequest(prompt="Still there?", sampling=pb.SamplingParams(max_tokens=3)),
                                   timeout=30))
    assert ok[-1].finish_reason == pb.FINISH_REASON_LENGTH and ok[-1].usage.completion_tokens == 3
    num = sum(router.outcomes.values())
    fault_report.add("hostile requests and bytes (hypothesis) on a router", injected=num, affected=num, clear=num,
                     leaked=len(backend.running), recovery_s=None,
                     note=f"outcomes {dict(router.outcomes)}; no stream left open")
