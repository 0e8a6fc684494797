"""/metrics of real clusters: the router's request metrics and every worker's, gathered
over Ray, counted exactly for a known workload; promtool accepts the exposition."""

from __future__ import annotations

import concurrent.futures

import pytest
from metrics_text import label_values, parse_samples, promtool_check_metrics, total
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [5, 40, 130]
MAX_TOKENS = [4, 9, 6]


def run_workload(cluster, tokenizer) -> tuple[dict, dict]:
    """The samples before and after three greedy requests that ignore EOS (so exactly MAX_TOKENS each)."""
    assert_workers_empty(cluster)
    before = parse_samples(cluster.scrape())
    stub = cluster.stub()
    requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=english_token_ids(tokenizer, n, skip=7 * n)),
                                   sampling=pb.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                for n, m in zip(PROMPT_LENGTHS, MAX_TOKENS)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: list(stub.Generate(r, timeout=120)), requests))
    assert_workers_empty(cluster)
    return before, parse_samples(cluster.scrape())


def grew(before, after, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def test_disaggregated_metrics(clusters, tokenizer, hf_model):
    cluster = clusters["disaggregated"]
    before, after = run_workload(cluster, tokenizer)
    n = len(PROMPT_LENGTHS)
    # Router: what the clients saw.
    assert grew(before, after, "tandem_time_to_first_token_seconds_count") == n
    assert grew(before, after, "tandem_request_success_total", finished_reason="length") == n
    assert grew(before, after, "tandem_generation_tokens_total") == sum(MAX_TOKENS)
    assert grew(before, after, "tandem_prompt_tokens_total") == sum(PROMPT_LENGTHS)
    assert grew(before, after, "tandem_router_queue_time_seconds_count") == n
    # Workers, each labelled with its role and instance.
    assert label_values(after, "tandem_worker_up", "instance") == {"d-prefill-0", "d-decode-0", "d-decode-1"}
    assert total(after, "tandem_worker_up") == 3
    assert label_values(after, "tandem_kv_cache_capacity_blocks", "role") == {"prefill", "decode"}
    assert grew(before, after, "tandem_request_prefill_time_seconds_count", role="prefill") == n
    assert grew(before, after, "tandem_request_queue_time_seconds_count", role="prefill") == n
    assert grew(before, after, "tandem_request_queue_time_seconds_count", role="decode") == n
    assert grew(before, after, "tandem_request_decode_time_seconds_count", role="decode") == n
    assert grew(before, after, "tandem_kv_transfer_time_seconds_count", role="prefill") == n
    assert grew(before, after, "tandem_kv_transfer_time_seconds_count", role="decode") == n
    assert grew(before, after, "tandem_prefix_cache_queries_total", role="prefill") == sum(PROMPT_LENGTHS)
    # Every prompt token's K and V in every layer, float32 (sizes from transformers' config),
    # but for those a decode worker still cached from earlier tests (never sent again).
    cfg = hf_model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    num_sent = sum(PROMPT_LENGTHS) - grew(before, after, "tandem_prefix_cache_hits_total", role="decode")
    assert grew(before, after, "tandem_prefix_cache_queries_total", role="decode") == sum(PROMPT_LENGTHS)
    assert grew(before, after, "tandem_kv_transfer_bytes_total", direction="sent") == num_sent * token_bytes
    assert grew(before, after, "tandem_kv_transfer_bytes_total", direction="received") == num_sent * token_bytes
    assert total(after, "tandem_kv_cache_used_blocks") == 0
    assert total(after, "tandem_num_requests_running") + total(after, "tandem_num_requests_waiting") == 0
    assert grew(before, after, "tandem_kv_transfer_failures_total") == 0
    if promtool_check_metrics(cluster.scrape()) is None:
        pytest.skip("promtool (Debian package prometheus) is not installed; CI installs it")


def test_colocated_metrics(clusters, tokenizer):
    cluster = clusters["colocated"]
    before, after = run_workload(cluster, tokenizer)
    n = len(PROMPT_LENGTHS)
    assert label_values(after, "tandem_worker_up", "role") == {"colocated"}
    assert grew(before, after, "tandem_request_prefill_time_seconds_count", role="colocated") == n
    assert grew(before, after, "tandem_request_decode_time_seconds_count", role="colocated") == n
    assert grew(before, after, "tandem_e2e_request_latency_seconds_count") == n
    assert total(after, "tandem_kv_transfer_bytes_total") == 0
    assert total(after, "tandem_kv_cache_capacity_blocks") > 0 == total(after, "tandem_kv_cache_used_blocks")
