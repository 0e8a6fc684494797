"""A worker's metrics over a real engine: observations and gauges match what the engine did."""

from __future__ import annotations

from metrics_text import parse_samples, promtool_check_metrics, total
from reference import english_token_ids

from tandem import SamplingParams
from tandem.worker.api import Role
from tandem.worker.metrics import WorkerMetrics, failure_kind


def test_colocated_engine_metrics(make_llm, tokenizer):
    metrics = WorkerMetrics(Role.COLOCATED, "colocated-0", "m")
    llm = make_llm(block_size=16, num_kv_blocks=12, max_num_batched_tokens=64, observer=metrics)
    prompt = english_token_ids(tokenizer, 70)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([prompt], params)
    llm.generate([prompt, english_token_ids(tokenizer, 60, skip=300)], params)  # a prefix hit, then preemption
    s = parse_samples(metrics.render(llm.engine))
    labels = dict(model_name="m", role="colocated", instance="colocated-0")
    assert total(s, "tandem_request_queue_time_seconds_count", **labels) == 3
    assert total(s, "tandem_request_prefill_time_seconds_count") == 3
    assert total(s, "tandem_request_decode_time_seconds_count") == 3
    # The repeat finds its first 4 full blocks cached (the last token is always computed).
    assert total(s, "tandem_prefix_cache_queries_total") == 70 + 70 + 60
    assert total(s, "tandem_prefix_cache_hits_total") == 64
    assert total(s, "tandem_prefix_cache_hit_rate") == 64 / 200
    # 12 blocks cannot hold 2 x (70 or 60 + 40) tokens: someone was preempted.
    assert total(s, "tandem_num_preemptions_total") == llm.engine.counters().num_preemptions > 0
    assert total(s, "tandem_kv_cache_capacity_blocks") == 12 and total(s, "tandem_kv_cache_used_blocks") == 0
    assert total(s, "tandem_kv_cache_usage_perc") == 0
    assert total(s, "tandem_batch_size") >= 1 and total(s, "tandem_batch_tokens") >= 1
    assert "tandem_kv_transfer_time_seconds" not in metrics.render(llm.engine)  # no transfers on a colocated worker
    promtool_check_metrics(metrics.render(llm.engine))


def test_transfer_failures_are_labelled_from_a_fixed_set():
    reasons = ("timed out waiting for the receiver", "aborted by the sender", "receiver: refused: layout",
               "receiver not accepting messages", "the disk is on fire")
    assert [failure_kind(r) for r in reasons] == ["timeout", "aborted", "refused", "unreachable", "error"]


def test_transfer_paths_are_counted_on_prefill_workers_only(make_llm):
    engine = make_llm(block_size=16, num_kv_blocks=4).engine
    prefill = WorkerMetrics(Role.PREFILL, "prefill-0", "m")
    for path in ("shm", "shm", "zmq"):
        prefill.transfer_began(path)
    s = parse_samples(prefill.render(engine))
    counts = {p: total(s, "tandem_kv_transfer_paths_total", role="prefill", path=p) for p in ("shm", "zmq", "dist")}
    assert counts == {"shm": 2, "zmq": 1, "dist": 0}  # every path's series from the start
    assert "tandem_kv_transfer_paths" not in WorkerMetrics(Role.DECODE, "decode-0", "m").render(engine)
    promtool_check_metrics(prefill.render(engine))
