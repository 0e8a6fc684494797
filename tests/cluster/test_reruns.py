"""Buffered requests survive a decode worker killed under them: they run again on the healthy
workers and the client gets the same greedy output as an undisturbed run."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import ray
from fault_calls import greedy, request, wait_until
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import assert_workers_empty, inventories, num_leaked_blocks

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


def test_buffered_requests_rerun_when_their_decode_worker_dies(clusters, tokenizer, fault_report):
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    assert_workers_empty(cluster)
    prompts = [english_token_ids(tokenizer, 24 + 8 * i, skip=90 + 17 * i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        expected = list(pool.map(lambda p: greedy(cluster, p, MAX_TOKENS), prompts))
    reruns_before = total(parse_samples(cluster.scrape()), "tandem_request_reruns_total")
    stub = cluster.stub()

    def buffered(prompt: list[int]) -> list[pb.GenerateResponse]:
        r = request(prompt, MAX_TOKENS)
        r.buffered = True
        return list(stub.Generate(r, timeout=300))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = []
        for p in prompts:  # one at a time, so that least_loaded spreads them over both decode workers
            futures.append(pool.submit(buffered, p))
            time.sleep(0.3)

        def running() -> dict[str, int]:
            return {i.instance: i.num_running for i in cluster.run(inventories(backend)) if i.role.value == "decode"}
        wait_until(lambda: all(running().values()), 60, "both decode workers decoding")
        on_victim = running()
        victim = max(backend.decode, key=lambda w: on_victim[w.instance])
        killed = time.monotonic()
        ray.kill(victim.handle, no_restart=False)
        results = [f.result(timeout=300) for f in futures]
        done_s = time.monotonic() - killed
    for responses, want in zip(results, expected):
        assert len(responses) == 1, "a buffered request gets one response"
        assert list(responses[0].token_ids) == want and responses[0].finish_reason == pb.FINISH_REASON_LENGTH
    num_reruns = total(parse_samples(cluster.scrape()), "tandem_request_reruns_total") - reruns_before
    assert num_reruns >= on_victim[victim.instance], (num_reruns, on_victim)
    wait_until(lambda: victim.healthy, 180, "the restarted decode worker is seen healthy")
    restart_s = time.monotonic() - killed
    assert_workers_empty(cluster, timeout=30)
    fault_report.add("decode worker killed under buffered requests", injected=1, affected=int(num_reruns),
                     clear=int(num_reruns), leaked=num_leaked_blocks(cluster), recovery_s=restart_s,
                     note=f"{int(num_reruns)} of 6 on it ({on_victim[victim.instance]} of them decoding) re-run; "
                          f"all 6 OK with the undisturbed greedy output {done_s:.1f} s after the kill; "
                          "recovery = Ray's restart, serving again")
