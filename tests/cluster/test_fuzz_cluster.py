"""Hostile requests against both real clusters, colocated and disaggregated (real workers,
real model): each call ends with a clear status (OK, INVALID_ARGUMENT naming the field, or
DEADLINE_EXCEEDED at the 3 s deadline), and afterwards every worker is empty and health
says SERVING."""

from __future__ import annotations

import collections
import time
from typing import Any

import grpc
import pytest
from fuzz_requests import check_outcome, generate_requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_checks import assert_workers_empty, num_leaked_blocks

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

NUM_EXAMPLES = {"colocated": 100, "disaggregated": 50, "local": 15}
"""Fewer on the disaggregated cluster: the same router checks the same fields; what it adds
is the other workers' side of each outcome (reservations, transfers; local prefills on the
decode workers through "local")."""
CALL_TIMEOUT_S = 3.0
MODES = tuple(NUM_EXAMPLES)
outcomes: dict[str, collections.Counter[str]] = {mode: collections.Counter() for mode in MODES}
FUZZ_SETTINGS: dict[str, Any] = dict(
    deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.function_scoped_fixture])


def send_hostile_request(cluster, mode: str, data) -> None:
    spec = cluster.backend.tokenizer_spec
    req = data.draw(generate_requests(spec.max_model_len, spec.vocab_size, cheap=True), label="request")
    responses: list[pb.GenerateResponse] = []
    error = None
    try:
        responses.extend(cluster.stub().Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        error = e
    outcomes[mode][check_outcome(req, responses, error,
                                 allowed=(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED))] += 1


@settings(max_examples=NUM_EXAMPLES["colocated"], **FUZZ_SETTINGS)
@given(data=st.data())
def test_hostile_requests_on_the_colocated_cluster(clusters, data):
    send_hostile_request(clusters["colocated"], "colocated", data)


@settings(max_examples=NUM_EXAMPLES["disaggregated"], **FUZZ_SETTINGS)
@given(data=st.data())
def test_hostile_requests_on_the_disaggregated_cluster(clusters, data):
    send_hostile_request(clusters["disaggregated"], "disaggregated", data)


@settings(max_examples=NUM_EXAMPLES["local"], **FUZZ_SETTINGS)
@given(data=st.data())
def test_hostile_requests_prefilled_on_the_decode_workers(clusters, data):
    send_hostile_request(clusters["local"], "local", data)


@pytest.mark.parametrize("mode", MODES)
def test_cluster_empty_and_healthy_after_the_fuzz(clusters, fault_report, mode):
    # Runs after the fuzz test (file order), on the same cluster.
    cluster = clusters[mode]
    seen = outcomes[mode]
    assert sum(seen.values()) >= NUM_EXAMPLES[mode]
    assert seen["OK"] >= 5 and seen["INVALID_ARGUMENT"] >= NUM_EXAMPLES[mode] // 5, seen
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
    leaked = num_leaked_blocks(cluster)
    assert leaked == 0
    num = sum(seen.values())
    fault_report.add(f"hostile requests (hypothesis) on the {mode} cluster", injected=num, affected=num, clear=num,
                     leaked=leaked, recovery_s=None, note=f"outcomes {dict(seen)}; the workers served on")
