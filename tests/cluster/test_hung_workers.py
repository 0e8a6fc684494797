"""A hung worker: SIGSTOP leaves the process alive to Ray (which restarts only the dead) but
answering nothing, the way a worker stuck in a driver call or a stalled transfer does. The
router must give up on it by itself, fail what waited on it, free the peers' blocks at once,
and take it back once it answers again."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest
import ray
from fault_calls import decode_inventories, greedy, read_to_end, request, wait_until
from mixed_streams import assert_equal_to, decode_running, run_mix
from reference import english_token_ids
from worker_checks import assert_workers_empty, inventories, num_leaked_blocks

pytestmark = pytest.mark.slow

NUM_HUNG_STREAMS = 6


def held_beyond_a_cut_write(cluster) -> dict[str, list[str]]:
    """What the decode workers hold beyond one aborted request each, whose blocks a stopped
    writer's grant still covers (num_aborting=1, with its blocks in use and referenced)."""
    found = {}
    for i in decode_inventories(cluster):
        num_in_use = i.num_blocks - i.num_free_blocks
        cut = {"num_aborting=1", f"{num_in_use} of {i.num_blocks} blocks in use",
               f"num_referenced_blocks={num_in_use}"} if i.num_aborting == 1 else set()
        leaks = [leak for leak in i.leaks() if leak not in cut]
        if leaks:
            found[i.instance] = leaks
    return found


def test_prefill_worker_hung_mid_transfer(clusters, tokenizer, fault_report):
    """Stop the only prefill worker while it prefills and sends KV: within the router's
    unresponsive_after_s every request on it ends UNAVAILABLE and the decode workers free the
    blocks they reserved (while it is still stopped); new requests are refused at once. Once it
    resumes, the KV it goes on sending for the aborted requests is refused by the decode workers
    (never written into blocks others now own), it frees everything, the router takes it back
    after its backoff, and greedy output is what it was before."""
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    (victim,) = backend.prefill
    assert_workers_empty(cluster)
    pid = ray.get(victim.handle.pid.remote())
    probe = english_token_ids(tokenizer, 300, skip=70)
    before = greedy(cluster, probe, 8)
    stub = cluster.stub()
    calls = []
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        for i in range(6):
            first = threading.Event()
            out: dict[str, Any] = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 400 + 60 * i, skip=20 * i), 8), timeout=300)
            pool.submit(read_to_end, call, first, out)
            calls.append((call, first, out))

        def held() -> dict[str, int]:
            (p,) = [i for i in cluster.run(inventories(backend)) if i.role.value == "prefill"]
            return dict(prefilling=p.num_running, queued=p.num_waiting, sending_kv=p.num_pending_transfers)
        wait_until(lambda: held()["sending_kv"] >= 1 and victim.num_in_flight >= 3, 120,
                   "a prompt's KV in transfer and others queued")
        on_it = held()
        pending = [out for _, _, out in calls if "code" not in out]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_until(lambda: all("code" in out for out in pending), backend.health.unresponsive_after_s + 15,
                       "the hung worker's requests end")
            # A request whose KV had all arrived finishes on its decode worker; the others fail.
            failed = [out for out in pending if out["code"] != grpc.StatusCode.OK]
            assert all(out["code"] == grpc.StatusCode.UNAVAILABLE for out in failed), failed
            assert len(failed) >= 3, pending
            end_s = max(out["ended"] for out in failed) - stopped
            assert not victim.healthy and not backend.is_ready()
            refused = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request(probe, 8), timeout=60))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            refused_s = time.monotonic() - refused
            # The decode workers hold nothing for the dead requests, the prefill worker still stopped,
            # but the blocks of a request whose in-place write the stop cut: those wait for its revoke.
            wait_until(lambda: not held_beyond_a_cut_write(cluster), 15, "the decode workers free their reservations",
                       state=lambda: held_beyond_a_cut_write(cluster))
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(lambda: victim.healthy, 120, "the resumed worker is taken back")
        back_s = time.monotonic() - resumed
        assert_workers_empty(cluster, timeout=60)
        assert greedy(cluster, probe, 8) == before
    finally:
        for call, _, _ in calls:
            call.cancel()
        pool.shutdown()
    assert_workers_empty(cluster, timeout=30)
    assert backend.is_ready() and all(w.healthy for w in backend.workers)
    fault_report.add("prefill worker hung (SIGSTOP) mid-transfer", injected=1, affected=len(failed),
                     clear=len(failed), leaked=num_leaked_blocks(cluster), recovery_s=back_s,
                     note=f"held {on_it}; {len(failed)} UNAVAILABLE {end_s:.1f} s after the stop, "
                          f"{len(pending) - len(failed)} finished (KV already there); new request refused in "
                          f"{refused_s:.2f} s; taken back {back_s:.1f} s after resuming")


def test_decode_worker_hung_for_good_is_killed_and_restarted(clusters, tokenizer, fault_report):
    """A decode worker that stays stopped mid-stream: the router marks it down after
    unresponsive_after_s, its streams move to the other decode worker (each equal to an
    uninterrupted run: router/migration.py) and, past restart_hung_after_s, has it killed; Ray
    restarts it and it serves again. (The bounds are shortened for the test: 15 s and 120 s by
    default.)"""
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    assert_workers_empty(cluster)
    health = backend.health
    bounds = health.unresponsive_after_s, health.restart_hung_after_s
    pool = concurrent.futures.ThreadPoolExecutor(NUM_HUNG_STREAMS)
    reference = run_mix(cluster, tokenizer, pool, num_streams=NUM_HUNG_STREAMS)
    assert_workers_empty(cluster, timeout=30)
    stop: dict[str, Any] = {}

    def stop_one(outs: list[dict[Any, Any]]) -> None:
        running = decode_running(cluster)
        stop["victim"] = max(backend.decode, key=lambda w: running[w.instance])
        stop["running"] = running[stop["victim"].instance]
        stop["pid"] = ray.get(stop["victim"].handle.pid.remote())
        health.unresponsive_after_s, health.restart_hung_after_s = 2.0, 5.0
        os.kill(stop["pid"], signal.SIGSTOP)
        stop["at"] = time.monotonic()
        watcher.start()

    def watch() -> None:
        while stop["victim"].healthy and time.monotonic() - stop["at"] < 10:
            time.sleep(0.05)
        stop["down_s"] = time.monotonic() - stop["at"]

    watcher = threading.Thread(target=watch, daemon=True)

    try:
        moved = run_mix(cluster, tokenizer, pool, before_kill=stop_one, num_streams=NUM_HUNG_STREAMS)
        victim, pid, stopped = stop["victim"], stop["pid"], stop["at"]
        assert_equal_to(reference, moved)
        assert stop["running"] > 0
        watcher.join(10)
        down_s = stop["down_s"]
        assert down_s < 10, "the stopped worker is marked down"
        # Meanwhile the other decode worker serves.
        assert greedy(cluster, english_token_ids(tokenizer, 20), 4)

        def restarted() -> bool:
            try:
                return ray.get(victim.handle.pid.remote(), timeout=1) != pid
            except Exception:  # noqa: BLE001 - being killed or restarted
                return False
        wait_until(restarted, 120, "the router has the hung worker killed and Ray restarts it")
        wait_until(lambda: victim.healthy, 120, "the restarted worker is taken back")
        recovery_s = time.monotonic() - stopped
    finally:
        pool.shutdown(cancel_futures=True)
        health.unresponsive_after_s, health.restart_hung_after_s = bounds
        if "pid" in stop:
            try:
                os.kill(stop["pid"], signal.SIGCONT)  # should it still be there
            except ProcessLookupError:
                pass
    assert_workers_empty(cluster, timeout=30)
    leaked = num_leaked_blocks(cluster)
    assert leaked == 0 and backend.is_ready()
    fault_report.add("decode worker hung for good (SIGSTOP, never resumed)", injected=1, affected=stop["running"],
                     clear=stop["running"], leaked=leaked, recovery_s=recovery_s,
                     note=f"{NUM_HUNG_STREAMS} streams (greedy, seeded, n=2, json_schema, stop strings), the "
                          f"{stop['running']} on it moved once it was marked down ({down_s:.1f} s after the stop, "
                          "bound 2 s), all OK and equal to the uninterrupted run; killed by the router after 5 s "
                          "of silence, restarted by Ray, serving again")
