"""An engine that raises (an error in its step, a forward out of memory) on a real cluster:
the worker fails its requests with UNAVAILABLE and a short message, ends its process, Ray
restarts it and the router routes to it again; nothing leaks, no stream hangs."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import grpc
import pytest
from fault_calls import assert_serves, awaited, read_to_end, request, wait_until
from reference import english_token_ids
from worker_checks import assert_workers_empty, num_leaked_blocks

pytestmark = pytest.mark.slow


def _pid(cluster, worker) -> int | None:
    try:
        return cluster.run(awaited(worker.handle.pid.remote()))
    except Exception:  # noqa: BLE001 - ending or restarting
        return None


def _inject_and_watch(cluster, tokenizer, worker, fault: str, num_requests: int, wait_first: bool):
    """Start `num_requests` long streams, inject `fault` into `worker` (after their first
    tokens when `wait_first`); -> (their outcomes, seconds from the fault to the last end,
    seconds from the fault to the restarted worker serving again)."""
    stub = cluster.stub()
    old_pid = _pid(cluster, worker)
    if not wait_first:
        cluster.run(awaited(worker.handle.inject_fault.remote(fault)))
    injected = time.monotonic()
    outs, pool = [], concurrent.futures.ThreadPoolExecutor(num_requests)
    try:
        for i in range(num_requests):
            first = threading.Event()
            out: dict[str, Any] = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 30 + 7 * i, skip=13 * i), 2000), timeout=300)
            pool.submit(read_to_end, call, first, out)
            outs.append((call, first, out))
        if wait_first:
            assert all(first.wait(120) for _, first, _ in outs)  # all decoding
            injected = time.monotonic()
            cluster.run(awaited(worker.handle.inject_fault.remote(fault)))
        wait_until(lambda: all("code" in out for _, _, out in outs), 30, "every request ends")
        end_s = max(out["ended"] for _, _, out in outs) - injected
        wait_until(lambda: _pid(cluster, worker) not in (None, old_pid), 60, "Ray restarts the worker's process")
        wait_until(lambda: worker.healthy, 180, "the router sees the restarted worker serve")
        recovery_s = time.monotonic() - injected
    finally:
        for call, _, _ in outs:
            call.cancel()
        pool.shutdown()
    return [out for _, _, out in outs], end_s, recovery_s


def _check_and_report(cluster, tokenizer, fault_report, name: str, outs: list[dict], end_s: float,
                      recovery_s: float, cause: str) -> None:
    unavailable = [o for o in outs if o["code"] == grpc.StatusCode.UNAVAILABLE]
    assert len(unavailable) == len(outs), outs
    # Short, naming the cause (or, once the router knew, that the worker went down or that no
    # worker could take it);
    # no Ray traceback, pid or address.
    assert any(cause in o["details"] for o in unavailable), outs
    for o in unavailable:
        assert (cause in o["details"] or "went down" in o["details"] or "the prefill worker is gone" in o["details"]
                or "no prefill worker is healthy" in o["details"]) and len(o["details"]) < 400, o["details"]
        assert not any(s in o["details"] for s in ("Traceback", "pid=", "ip=", ".py")), o["details"]
    assert_serves(cluster, tokenizer)
    assert_workers_empty(cluster, timeout=30)
    leaked = num_leaked_blocks(cluster)
    assert leaked == 0
    fault_report.add(name, injected=1, affected=len(outs), clear=len(unavailable), leaked=leaked,
                     recovery_s=recovery_s,
                     note=f"{len(outs)} requests all UNAVAILABLE within {end_s:.2f} s (e.g. {cause!r}); "
                          "recovery = the process ends, Ray restarts it, serving again")


CASES = {
    # A colocated worker whose step raises mid-stream: its streams end UNAVAILABLE at once.
    "step": ("colocated", "colocated", 3, True, 5.0, "exception injected into the engine step",
             "RuntimeError: injected fault in the engine step"),
    # The prefill worker's forward runs out of memory: the requests in prefill or queued on it
    # end UNAVAILABLE, the decode workers free what they reserved for them.
    "out_of_memory": ("disaggregated", "prefill", 4, False, 10.0, "forward out of memory (prefill worker)",
                      "OutOfMemoryError: injected: out of memory in the forward"),
}


@pytest.mark.parametrize("fault", CASES)
def test_engine_error_fails_requests_and_restarts_the_worker(clusters, tokenizer, fault_report, fault):
    mode, pool, num_requests, wait_first, max_end_s, name, cause = CASES[fault]
    cluster = clusters[mode]
    assert_workers_empty(cluster)
    worker = getattr(cluster.backend, pool)[0]
    outs, end_s, recovery_s = _inject_and_watch(cluster, tokenizer, worker, fault, num_requests, wait_first)
    assert end_s < max_end_s
    _check_and_report(cluster, tokenizer, fault_report, name, outs, end_s, recovery_s, cause)
