"""A decode worker killed mid-stream on the real disaggregated cluster (1 prefill + 2 decode Ray
actors): 16 streaming requests mixing greedy, seeded sampling (temperature 0.8, top-p 0.9),
n=2, a JSON schema and stop strings all end OK, every client's stream equal (tokens and
text, per completion) to an uninterrupted run of the same requests (router/migration.py); Ray
restarts the worker, which serves again; nothing leaks. The fault table's row reports what
the migration added to each moved stream (tandem_request_migration_seconds)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import pytest
import ray
from fault_calls import request, wait_until
from mixed_streams import NUM_STREAMS, assert_equal_to, decode_running, migrations, outputs, run_mix
from reference import english_token_ids
from worker_checks import assert_workers_empty, num_leaked_blocks

pytestmark = pytest.mark.slow

def assert_each_decode_worker_serves(cluster, tokenizer) -> None:
    """Two long greedy streams, one after the other, land one on each decode worker and decode."""
    stub = cluster.stub()
    calls = []
    try:
        for i in range(2):
            calls.append(stub.Generate(request(english_token_ids(tokenizer, 16, skip=11 * i), 400), timeout=120))
            assert next(calls[-1]).token_ids
            time.sleep(0.3)  # the router's poller refreshes the loads
        running = decode_running(cluster)
        assert sorted(running.values()) == [1, 1], running
    finally:
        for call in calls:
            call.cancel()


def test_decode_worker_killed_mid_stream_loses_no_request(clusters, tokenizer, reference, fault_report):
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    pool = concurrent.futures.ThreadPoolExecutor(NUM_STREAMS)
    try:
        before = migrations(cluster)
        killed: dict[str, Any] = {}

        def kill(outs: list[dict[Any, Any]]) -> None:
            running = decode_running(cluster)
            assert all(running.values()), running  # the streams are on both decode workers
            killed["victim"] = max(backend.decode, key=lambda w: running[w.instance])
            killed["running"] = running[killed["victim"].instance]
            killed["unfinished"] = sum("code" not in o for o in outs)
            killed["at"] = time.monotonic()
            ray.kill(killed["victim"].handle, no_restart=False)

        migrated = run_mix(cluster, tokenizer, pool, before_kill=kill)
        ended_s = time.monotonic() - killed["at"]
    finally:
        pool.shutdown(cancel_futures=True)
    assert_equal_to(reference, migrated)
    # the mix really held what it should: a JSON value that validates, both completions of n=2
    assert all(set(outputs(o)) == ({0, 1} if i % 5 == 2 else {0}) for i, o in enumerate(migrated))
    for i in range(3, NUM_STREAMS, 5):
        parsed = json.loads(migrated[i][0]["text"])
        assert set(parsed) == {"name", "age"}, parsed
    num_moved, added_s = (b - a for a, b in zip(before, migrations(cluster)))
    assert num_moved >= killed["running"] > 0  # (an n=2 stream moves as two)

    victim = killed["victim"]
    wait_until(lambda: victim.healthy, 180, "the restarted worker is seen healthy")
    restart_s = time.monotonic() - killed["at"]
    assert_each_decode_worker_serves(cluster, tokenizer)
    assert_workers_empty(cluster, timeout=30)
    assert backend.is_ready()
    fault_report.add("decode worker killed mid-stream", injected=1, affected=killed["running"],
                     clear=killed["running"], leaked=num_leaked_blocks(cluster), recovery_s=restart_s,
                     note=f"{NUM_STREAMS} streams (greedy, seeded, n=2, json_schema, stop strings), "
                          f"{killed['running']} on the victim moved ({int(num_moved)} completions, adding "
                          f"{added_s / num_moved:.2f} s each on average), all {NUM_STREAMS} OK and equal to the "
                          f"uninterrupted run; the mix ended {ended_s:.1f} s after the kill; recovery = Ray's "
                          "restart, serving again")
