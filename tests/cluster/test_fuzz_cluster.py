"""Hostile requests against the real colocated cluster (real workers, real model): each
call ends with a clear status (OK, INVALID_ARGUMENT naming the field, or DEADLINE_EXCEEDED
at the 3 s deadline), and afterwards every worker is empty and health says SERVING."""

from __future__ import annotations

import collections
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_requests import check_outcome, generate_requests
from tandem.proto import generation_pb2 as pb
from worker_checks import assert_workers_empty

pytestmark = pytest.mark.slow

NUM_EXAMPLES = 100
CALL_TIMEOUT_S = 3.0
outcomes: collections.Counter[str] = collections.Counter()


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_requests_on_the_cluster_get_a_clear_status(clusters, data):
    cluster = clusters["colocated"]
    spec = cluster.backend.tokenizer_spec
    req = data.draw(generate_requests(spec.max_model_len, spec.vocab_size, cheap=True), label="request")
    responses: list[pb.GenerateResponse] = []
    error = None
    try:
        responses.extend(cluster.stub().Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        error = e
    outcomes[check_outcome(req, responses, error,
                           allowed=(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED))] += 1


def test_cluster_empty_and_healthy_after_the_fuzz(clusters, fault_report):
    # Runs after the fuzz test (file order), on the same cluster.
    cluster = clusters["colocated"]
    print("cluster fuzz outcomes:", dict(outcomes))
    assert sum(outcomes.values()) >= NUM_EXAMPLES
    assert outcomes["OK"] >= 5 and outcomes["INVALID_ARGUMENT"] >= 20, outcomes
    assert_workers_empty(cluster)
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.port}")
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="tandem.v1.Generation"),
                                                        timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    start = time.monotonic()
    ok = list(cluster.stub().Generate(pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True)), timeout=60))
    assert ok[-1].usage.completion_tokens == 3, (ok, time.monotonic() - start)
    assert_workers_empty(cluster)
    num = sum(outcomes.values())
    fault_report.add("hostile requests (hypothesis) on a real cluster", injected=num, affected=num, clear=num,
                     leaked=0, recovery_s=None, note=f"outcomes {dict(outcomes)}; the worker served on")
