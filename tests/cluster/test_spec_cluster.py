"""Speculative decoding by prompt lookup on a disaggregated cluster's decode worker: greedy
output stays transformers' token for token while drafts are accepted."""

from __future__ import annotations

import pytest
from metrics_text import parse_samples, total
from reference import english_token_ids, hf_greedy
from running_cluster import running_clusters
from worker_checks import assert_workers_empty

from tandem.config import WorkerConfig
from tandem.proto import generation_pb2 as pb
from tandem.router.cluster import ClusterConfig

pytestmark = pytest.mark.slow

SPEC_WORKER = WorkerConfig.build(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, num_threads=1,
                                 num_speculative_tokens=4, quantization="none")


@pytest.fixture(scope="module")
def spec_cluster(clusters):
    config = ClusterConfig(num_prefill=1, num_decode=1, disagg_policy="always", worker=SPEC_WORKER,
                           name_prefix="spec-")
    with running_clusters({"spec": config}, clusters["colocated"].loop) as started:
        yield started["spec"]


def test_speculative_decode_worker_keeps_greedy_output(spec_cluster, hf_model, tokenizer, loaded):
    # A passage, then an instruction to repeat it: the output copies the prompt, so lookups hit.
    passage = tokenizer.decode(english_token_ids(tokenizer, 60, skip=40))
    prompt = tokenizer.encode(f"{passage}\n\nRepeat the text above exactly:\n\n{passage[:40]}")
    eos = loaded.config.eos_token_ids
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=40))
    tokens = [t for r in spec_cluster.stub().Generate(request, timeout=300) for t in r.token_ids]
    assert tokens == hf_greedy(hf_model, prompt, 40, eos)
    samples = parse_samples(spec_cluster.scrape())
    accepted = total(samples, "tandem_spec_decode_num_accepted_tokens_total", role="decode")
    drafted = total(samples, "tandem_spec_decode_num_draft_tokens_total", role="decode")
    assert 0 < accepted <= drafted
    assert_workers_empty(spec_cluster)
