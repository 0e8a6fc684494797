"""The disaggregated cluster on the tests' one-node Ray: its prefill worker writes the KV
straight into the decode workers' pools in shared memory (the default path between workers
of one node), and the output is token for token the single-process engine's."""

from __future__ import annotations

import pytest
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

PATHS = ("shm", "zmq", "dist")


def transfer_paths(cluster) -> dict[str, float]:
    samples = parse_samples(cluster.scrape())
    return {p: total(samples, "tandem_kv_transfer_paths_total", role="prefill", path=p) for p in PATHS}


def test_kv_goes_in_place_between_workers_of_one_node(clusters, make_llm, tokenizer):
    cluster = clusters["disaggregated"]
    prompts = [english_token_ids(tokenizer, n, skip=53 * i) for i, n in enumerate([5, 33, 120])]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.token_ids for o in make_llm().generate(prompts, params)]
    before = transfer_paths(cluster)
    stub = cluster.stub()
    got = []
    for ids in prompts:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=8))
        got.append([t for r in stub.Generate(request, timeout=120) for t in r.token_ids])
    assert got == expected
    after = transfer_paths(cluster)
    assert {p: after[p] - before[p] for p in PATHS} == {"shm": len(prompts), "zmq": 0, "dist": 0}
    assert_workers_empty(cluster)
