"""The disaggregated cluster end to end: real Ray actors, real KV transfer, gRPC on loopback."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow


def greedy_request(token_ids: list[int], max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=token_ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))

MODES = ["disaggregated", "colocated", "local"]


def collect(stub, request, timeout: float = 120) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    responses = list(stub.Generate(request, timeout=timeout))
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text for r in responses), responses


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_equals_the_single_process_engine(clusters, make_llm, tokenizer, mode):
    """Eight prompts together (both decode workers busy), token for token the engine's."""
    cluster = clusters[mode]
    prompts = [english_token_ids(tokenizer, n, skip=41 * i) for i, n in enumerate([3, 17, 40, 64, 100, 150, 260, 9])]
    max_tokens = [12, 5, 16, 9, 12, 7, 10, 16]
    expected = [o.token_ids for o in make_llm().generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])]
    stub = cluster.stub()
    before = decoded_per_worker(cluster)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # Sent at once: the router counts what it placed on each decode worker until a
        # polled load shows it, so the burst splits instead of piling onto one worker.
        got = list(pool.map(lambda i: collect(stub, greedy_request(prompts[i], max_tokens[i]))[0], range(len(prompts))))
    assert got == expected
    assert_workers_empty(cluster)
    after = decoded_per_worker(cluster)
    served = {instance: after[instance] - before[instance] for instance in after}
    assert sum(served.values()) == len(prompts), served
    if mode != "colocated":  # both decode workers took requests
        assert len(served) == 2 and all(n >= 2 for n in served.values()), served


def decoded_per_worker(cluster) -> dict[str, float]:
    """Requests each decoding worker (decode, or colocated) has decoded to their end so far,
    from its own metrics as the router's /metrics gathers them."""
    samples = parse_samples(cluster.scrape())
    return {w.instance: total(samples, "tandem_request_decode_time_seconds_count", instance=w.instance)
            for w in cluster.backend.decode + cluster.backend.colocated}


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_streams_add_up_to_their_text(clusters, tokenizer, mode):
    cluster = clusters[mode]
    stub = cluster.stub()
    prompts = [english_token_ids(tokenizer, 5 + 7 * i, skip=13 * i) for i in range(32)]

    def one(i: int):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]),
                                     sampling=pb.SamplingParams(temperature=0.8, seed=i, max_tokens=8))
        return collect(stub, request)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for ids, text, responses in results:
        last = responses[-1]
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        assert last.usage.completion_tokens == len(ids) and 1 <= len(ids) <= 8
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_client_cancel_frees_blocks_on_every_worker(clusters, tokenizer, mode):
    cluster = clusters[mode]
    call = cluster.stub().Generate(greedy_request(english_token_ids(tokenizer, 300), 2000) , timeout=120)
    pb_first = next(call)  # decoding has started
    assert pb_first.token_ids
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_deadline_frees_blocks_on_every_worker(clusters, tokenizer, mode):
    cluster = clusters[mode]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=english_token_ids(tokenizer, 200)),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub().Generate(request, timeout=1.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_workers_empty(cluster)


def test_bad_requests_are_invalid_and_the_server_keeps_serving(clusters, tokenizer):
    cluster = clusters["disaggregated"]
    stub = cluster.stub()
    bad = {
        "prompt": pb.GenerateRequest(prompt=""),
        "max_tokens": pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=-1)),
        "temperature": pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(temperature=float("nan"))),
        "token_ids": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**7])),
        "prompt too long": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100_000)),
    }
    for field, request in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field.split()[0] in e.value.details() or "max_model_len" in e.value.details(), (field, e.value.details())
    ids, _, _ = collect(stub, greedy_request(english_token_ids(tokenizer, 10), 4))
    assert len(ids) == 4
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES[:2])  # ("local" is a router over the disaggregated workers)
def test_health_reports_serving(clusters, mode):
    channel = grpc.insecure_channel(f"127.0.0.1:{clusters[mode].port}")
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="tandem.v1.Generation"),
                                                          timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
