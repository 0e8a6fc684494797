"""Faults against the real disaggregated cluster (1 prefill + 2 decode Ray actors): a storm of
client cancels at random moments, and the prefill worker killed with prompts in prefill and
queued (a decode worker killed mid-stream: test_migration_cluster.py). Each adds its row to the fault table (injected,
affected, ended with a clear status, leaked, recovery) and ends with every worker empty."""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import random
import threading
import time
from typing import Any

import grpc
import pytest
import ray
from fault_calls import CLEAR, assert_serves, decode_leaks, greedy, read_to_end, request, wait_until
from reference import english_token_ids
from worker_checks import assert_workers_empty, inventories, num_leaked_blocks

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

STORM_REQUESTS = 600
STORM_SPREAD_S = 12.0
"""Cancels and deadlines fall uniformly in [0, STORM_SPREAD_S) after the storm starts."""


def test_cancel_storm_leaves_every_worker_empty(clusters, tokenizer, fault_report):
    """STORM_REQUESTS concurrent requests, each cancelled by the client (call.cancel()) or by
    its deadline at a random moment: waiting for KV room, queued or running on the prefill
    worker, in transfer, or decoding. Every call ends with a clear status; nothing leaks."""
    cluster = clusters["disaggregated"]
    assert_workers_empty(cluster)
    rng = random.Random(7)
    stub = cluster.stub()
    # Peaks of what the workers held during the storm: where the cancels landed.
    peaks: collections.Counter[str] = collections.Counter()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            seen = collections.Counter(admitting=cluster.backend.num_admitting)
            try:
                sampled = cluster.run(inventories(cluster.backend))
            except TimeoutError:  # workers too busy to answer this sample: the next one counts
                continue
            for i in sampled:
                if i.role.value == "prefill":
                    seen.update(prefill_queued=i.num_waiting, prefilling=i.num_running,
                                sending_kv=i.num_pending_transfers)
                else:
                    seen.update(awaiting_kv=i.num_reserved, decoding=i.num_running)
            for k, v in seen.items():
                peaks[k] = max(peaks[k], v)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    calls, cancels = [], []
    for i in range(STORM_REQUESTS):
        prompt = english_token_ids(tokenizer, rng.randint(4, 120), skip=rng.randint(0, 500))
        at = rng.uniform(0, STORM_SPREAD_S)
        if i % 4 == 3:  # a quarter end by their deadline
            calls.append(stub.Generate(request(prompt, rng.randint(8, 64)), timeout=max(at, 0.01)))
        else:
            calls.append(stub.Generate(request(prompt, rng.randint(8, 64)), timeout=120))
            cancels.append((start + at, i))
    heapq.heapify(cancels)
    while cancels:
        at, i = heapq.heappop(cancels)
        time.sleep(max(0.0, at - time.monotonic()))
        calls[i].cancel()
    codes = collections.Counter(call.code() for call in calls)  # each blocks until its call ended
    storm_s = time.monotonic() - start
    sampling.set()
    sampler.join()
    assert_workers_empty(cluster, timeout=60)
    settle_s = time.monotonic() - start - storm_s
    clear = sum(n for code, n in codes.items() if code in CLEAR)
    fault_report.add("cancel storm (client cancels, deadlines)", injected=STORM_REQUESTS, affected=STORM_REQUESTS,
                     clear=clear, leaked=num_leaked_blocks(cluster), recovery_s=settle_s,
                     note=f"{', '.join(f'{c.name} {n}' for c, n in codes.most_common())} over {storm_s:.1f} s; "
                          f"peaks held: {dict(peaks)}; recovery = storm over to every worker empty")
    unclear = [f"{c.code().name}: {c.details()}" for c in calls if c.code() not in CLEAR]
    assert clear == STORM_REQUESTS, (codes, unclear[:5])
    assert codes[grpc.StatusCode.CANCELLED] > 0 and codes[grpc.StatusCode.DEADLINE_EXCEEDED] > 0
    # The cancels landed in every phase.
    assert all(peaks[k] > 0 for k in ("admitting", "prefill_queued", "awaiting_kv", "decoding")), peaks
    assert_serves(cluster, tokenizer)
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "local"])
def test_abort_by_client_id_and_reusing_the_id_at_once(clusters, tokenizer, mode):
    """The workers know each call by the router's own id: Abort(request_ids) still finds the
    client's call, and the same id can be reused at once (also while the workers still clean
    up the earlier call, e.g. right after its deadline)."""
    cluster = clusters[mode]
    stub = cluster.stub()
    long = request(english_token_ids(tokenizer, 60), 2000)
    long.request_id = f"reused-{mode}"
    call = stub.Generate(long, timeout=120)
    assert next(call).token_ids  # decoding
    assert list(stub.Abort(pb.AbortRequest(request_ids=[long.request_id]), timeout=30).aborted_request_ids) == [
        long.request_id]
    responses = list(call)
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    for timeout in (0.3, 120):  # a deadline mid-prefill, then the same id again at once
        again = request(english_token_ids(tokenizer, 200, skip=3), 4)
        again.request_id = long.request_id
        try:
            responses = list(stub.Generate(again, timeout=timeout))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout < 1, e
        else:
            assert {r.request_id for r in responses} == {long.request_id}
            assert sum(len(r.token_ids) for r in responses) == 4
    assert_workers_empty(cluster)


def test_prefill_worker_killed_with_requests_queued_and_in_prefill(clusters, tokenizer, fault_report):
    """Kill the only prefill worker while long prompts are in prefill or queued behind it: each
    ends promptly with UNAVAILABLE, the decode workers free what they had reserved for them, a
    request sent while it is down gets UNAVAILABLE at once, Ray restarts it, the router sees it
    serve again and a request then gets the same greedy output as before the kill."""
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    (victim,) = backend.prefill
    assert_workers_empty(cluster)
    stub = cluster.stub()
    probe = english_token_ids(tokenizer, 700, skip=50)
    before = greedy(cluster, probe, 8)
    calls = []
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        for i in range(6):
            first = threading.Event()
            out: dict[str, Any] = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 600 + 80 * i, skip=40 * i), 8), timeout=300)
            pool.submit(read_to_end, call, first, out)
            calls.append((call, first, out))

        def in_prefill() -> tuple[int, int]:
            (i,) = [i for i in cluster.run(inventories(backend)) if i.role.value == "prefill"]
            return i.num_running, i.num_waiting
        # The first prompt is in prefill and others are queued behind it (on the worker, or in
        # the actor's mailbox: Ray runs a few of its async calls at once).
        wait_until(lambda: in_prefill()[0] >= 1 and victim.num_in_flight >= 3, 60, "prompts in prefill and queued")
        running, waiting = in_prefill()
        pending = [out for _, _, out in calls if "code" not in out]
        killed = time.monotonic()
        ray.kill(victim.handle, no_restart=False)

        # Every request it held (or that waited for it) ends promptly with UNAVAILABLE.
        wait_until(lambda: all("code" in out for out in pending), 20, "the killed worker's requests end")
        assert all(out["code"] == grpc.StatusCode.UNAVAILABLE for out in pending), pending
        end_s = max(out["ended"] for out in pending) - killed
        assert not victim.healthy  # no more routing to it
        assert not backend.is_ready()

        # While it restarts, a new request is refused at once, not left waiting for it.
        refused = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(probe, 8), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        refused_s = time.monotonic() - refused
        assert refused_s < 5, refused_s
        # The decode workers freed the blocks they had reserved for all of them.
        deadline = time.monotonic() + 15
        while found := decode_leaks(cluster):
            assert time.monotonic() < deadline, f"decode workers not empty after 15 s: {found}"
            time.sleep(0.1)

        # Ray restarts it (the model loads again); the router's poller sees it serve again.
        wait_until(lambda: victim.healthy, 180, "the restarted prefill worker is seen healthy")
        assert backend.is_ready()
        assert_workers_empty(cluster)
        after = greedy(cluster, probe, 8)
        restart_s = time.monotonic() - killed
        assert after == before, (before, after)
    finally:
        for call, _, _ in calls:
            call.cancel()
        pool.shutdown()
    assert_workers_empty(cluster, timeout=30)
    assert backend.is_ready() and all(w.healthy for w in backend.workers)
    fault_report.add("prefill worker killed in prefill", injected=1, affected=len(pending), clear=len(pending),
                     leaked=num_leaked_blocks(cluster), recovery_s=restart_s,
                     note=f"{running} in prefill, {waiting} queued on it, {len(pending) - running - waiting} not yet "
                          f"on it: all UNAVAILABLE within {end_s:.2f} s; a request sent while it was down refused "
                          f"with UNAVAILABLE in {refused_s:.2f} s")
