"""A burst far above what a 1+1 cluster serves at once: every request completes, token for
token the single-process engine's, because no timeout counts time spent waiting in a queue.

The KV transfer timeout here is 1 s on both sides, while the burst keeps prompts queued on
the prefill worker (behind long prompts chunked 64 tokens a step) for several seconds: a
timeout counted from admission instead of from the first layer fails them."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from reference import english_token_ids
from running_cluster import running_clusters
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.config import KVTransferConfig, WorkerConfig
from tandem.proto import generation_pb2 as pb
from tandem.router.cluster import ClusterConfig

pytestmark = pytest.mark.slow

BURST_WORKER = WorkerConfig.build(kv_cache_memory_gib=0.15, max_num_batched_tokens=64, num_threads=1,
                                  quantization="none", kv_transfer=KVTransferConfig(timeout_s=1.0))
NUM_LONG, LONG_TOKENS, NUM_SHORT, SHORT_TOKENS, MAX_TOKENS = 4, 400, 12, 20, 4


@pytest.fixture(scope="module")
def burst_cluster(clusters):
    config = ClusterConfig(num_prefill=1, num_decode=1, worker=BURST_WORKER, name_prefix="burst-",
                           disagg_policy="always")
    with running_clusters({"burst": config}, clusters["colocated"].loop) as started:
        yield started["burst"]


def test_a_burst_of_long_and_short_prompts_all_complete(burst_cluster, make_llm, tokenizer):
    lengths = [LONG_TOKENS] * NUM_LONG + [SHORT_TOKENS] * NUM_SHORT
    prompts = [english_token_ids(tokenizer, n, skip=37 * i) for i, n in enumerate(lengths)]
    expected = [o.token_ids for o in make_llm().generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    stub = burst_cluster.stub()

    def generate(prompt: list[int]) -> tuple[grpc.StatusCode, list[int]]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        try:
            return grpc.StatusCode.OK, [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]
        except grpc.RpcError as e:
            return e.code(), [e.details()]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(generate, prompts))  # all sent at once
    assert got == [(grpc.StatusCode.OK, tokens) for tokens in expected]
    assert_workers_empty(burst_cluster)
