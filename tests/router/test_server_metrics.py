"""The router's /metrics over real HTTP: request metrics counted exactly, workers' metrics
merged by family, and an exposition that Prometheus' promtool accepts."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from fake_backend import FakeBackend
from metrics_text import label_values, parse_samples, promtool_check_metrics, total
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.backend import Overloaded
from tandem.router.server import metrics_port
from tandem.router.worker_metrics import WorkerMetricsReport

MODEL = "SmolLM2-135M-Instruct"


def worker_text(role: str, instance: str, running: int) -> str:
    """A worker's exposition as prometheus_client renders it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = dict(model_name=MODEL, role=role, instance=instance)
    Gauge("tandem_num_requests_running", "Running.", list(labels), registry=registry).labels(**labels).set(running)
    Counter("tandem_num_preemptions", "Preemptions.", list(labels), registry=registry).labels(**labels).inc(running)
    return generate_latest(registry).decode()


async def scrape(server) -> str:
    url = f"http://127.0.0.1:{metrics_port(server)}/metrics"
    # Off the loop: gathering the workers' metrics waits on this loop.
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())


def test_requests_are_counted_exactly(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_reports=[
        WorkerMetricsReport("prefill", "prefill-0", worker_text("prefill", "prefill-0", 2), True),
        WorkerMetricsReport("decode", "decode-0", worker_text("decode", "decode-0", 5), True),
        WorkerMetricsReport("decode", "decode-1", None, False),
    ])
    max_tokens = [3, 5, 7]

    async def body() -> str:
        async with serving(backend, metrics_port=0) as (channel, server):
            stub = pb_grpc.GenerationStub(channel)
            for n in max_tokens:
                request = pb.GenerateRequest(prompt="Hi there", sampling=pb.SamplingParams(max_tokens=n))
                async for _ in stub.Generate(request):
                    pass
            with pytest.raises(grpc.aio.AioRpcError):  # invalid: counted as rejected
                async for _ in stub.Generate(pb.GenerateRequest(prompt="")):
                    pass
            backend.fail_with = Overloaded("full")
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in stub.Generate(pb.GenerateRequest(prompt="Hi")):
                    pass
            return await scrape(server)

    text = asyncio.run(body())
    s = parse_samples(text)
    n_prompt = len(router_tokenizer.encode("Hi there"))
    assert total(s, "tandem_time_to_first_token_seconds_count", model_name=MODEL) == 3
    assert total(s, "tandem_e2e_request_latency_seconds_count") == 3
    assert total(s, "tandem_request_time_per_output_token_seconds_count") == 3
    # One gap fewer than tokens, per request.
    assert total(s, "tandem_inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert total(s, "tandem_generation_tokens_total") == sum(max_tokens)
    assert total(s, "tandem_prompt_tokens_total") == 3 * n_prompt
    assert total(s, "tandem_request_prompt_tokens_sum") == 3 * n_prompt
    assert total(s, "tandem_request_generation_tokens_sum") == sum(max_tokens)
    assert total(s, "tandem_request_success_total", finished_reason="length") == 3
    assert total(s, "tandem_request_status_total", code="OK") == 3
    assert total(s, "tandem_request_status_total", code="INVALID_ARGUMENT") == 1
    assert total(s, "tandem_request_status_total", code="RESOURCE_EXHAUSTED") == 1
    assert total(s, "tandem_request_rejected_total", reason="invalid_argument") == 1
    assert total(s, "tandem_request_rejected_total", reason="overloaded") == 1
    assert total(s, "tandem_router_num_requests_running") == 0
    # Workers: one family per name however many workers report it; the silent one is down.
    assert text.count("# TYPE tandem_num_requests_running gauge") == 1
    assert total(s, "tandem_num_requests_running", role="decode") == 5
    assert total(s, "tandem_num_preemptions_total", instance="prefill-0") == 2
    assert total(s, "tandem_worker_up", instance="decode-0") == 1
    assert total(s, "tandem_worker_up", instance="decode-1") == 0
    assert label_values(s, "tandem_worker_up", "instance") == {"prefill-0", "decode-0", "decode-1"}
    if promtool_check_metrics(text) is None:
        pytest.skip("promtool (Debian package prometheus) is not installed; CI installs it")


def test_a_stream_closed_by_the_client_counts_as_cancelled(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.05)

    async def body() -> str:
        async with serving(backend, metrics_port=0) as (channel, server):
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=50)))
            await call.read()
            call.cancel()
            assert backend.closed_event is not None  # set by the first generate
            await asyncio.wait_for(backend.closed_event.wait(), 5)
            for _ in range(100):  # the servicer counts it as its task unwinds
                text = await scrape(server)
                if "CANCELLED" in text:
                    return text
                await asyncio.sleep(0.02)
            return text

    s = parse_samples(asyncio.run(body()))
    assert total(s, "tandem_request_status_total", code="CANCELLED") == 1
    assert total(s, "tandem_time_to_first_token_seconds_count") == 1
    assert total(s, "tandem_e2e_request_latency_seconds_count") == 0  # not finished
    assert total(s, "tandem_router_num_requests_running") == 0
