"""A decode worker that stops answering, on the real disaggregated cluster: the prefill
worker's engine loop never waits on it (handshakes run off the loop), the router routes
around it, the other decode worker serves every request meanwhile, and nothing is left
held once it resumes."""

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
import zmq
from fault_calls import awaited, greedy, read_to_end, request, wait_until
from reference import english_token_ids
from worker_checks import assert_workers_empty, num_leaked_blocks

from tandem.kvtransfer.protocol import Destination
from tandem.sampling_params import SamplingParams
from tandem.worker.api import WorkerRequest

pytestmark = pytest.mark.slow


def test_a_silent_receiver_does_not_stall_the_prefill_engine(clusters, tokenizer):
    """The prefill worker shakes hands with a receiver that never answers (10 s): meanwhile
    its engine loop goes round and other requests are served at once."""
    cluster = clusters["disaggregated"]
    assert_workers_empty(cluster)
    prefill = cluster.backend.prefill[0]
    silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        prompt = english_token_ids(tokenizer, 20)
        stuck = prefill.handle.prefill.remote(WorkerRequest("silent-1", prompt, SamplingParams(max_tokens=2)),
                                              Destination("silent-1", f"tcp://127.0.0.1:{port}", (0, 1), len(prompt)))
        time.sleep(0.5)  # the handshake is under way
        start = time.monotonic()
        assert greedy(cluster, english_token_ids(tokenizer, 12, skip=40), 4)
        served_s = time.monotonic() - start
        stuck_s = ray.get(prefill.handle.heartbeat.remote())
        with pytest.raises(Exception, match="no KV receiver answered"):
            ray.get(stuck, timeout=60)
    finally:
        silent.close()
    assert served_s < 5 and stuck_s < 2, (served_s, stuck_s)
    assert_workers_empty(cluster)


def test_stopped_decode_worker_while_prefill_serves_others(clusters, tokenizer, fault_report):
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    assert_workers_empty(cluster)
    victim, survivor = backend.decode
    pid = ray.get(victim.handle.pid.remote())
    bounds = backend.health.unresponsive_after_s
    backend.health.unresponsive_after_s = 3.0  # (15 s by default)
    stub = cluster.stub()
    outs = []
    pool = concurrent.futures.ThreadPoolExecutor(6)
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        for i in range(6):
            first = threading.Event()
            out: dict[str, Any] = {}
            call = stub.Generate(request(english_token_ids(tokenizer, 16 + 8 * i, skip=17 * i), 8), timeout=120)
            pool.submit(read_to_end, call, first, out)
            outs.append(out)
        wait_until(lambda: all("code" in out for out in outs), 90, "every request ends")
        served_s = max(out["ended"] for out in outs) - stopped
        assert all(out["code"] == grpc.StatusCode.OK for out in outs), outs
        assert not victim.healthy and survivor.healthy
    finally:
        os.kill(pid, signal.SIGCONT)
        backend.health.unresponsive_after_s = bounds
        pool.shutdown()
    wait_until(lambda: victim.healthy, 120, "the resumed worker is taken back")
    assert_workers_empty(cluster, timeout=60)
    leaked = num_leaked_blocks(cluster)
    assert leaked == 0
    assert cluster.run(awaited(victim.handle.pid.remote())) == pid  # resumed, not restarted
    fault_report.add("decode worker stopped while prefill serves others", injected=1, affected=len(outs),
                     clear=len(outs), leaked=leaked, recovery_s=None,
                     note=f"{len(outs)} requests sent after the stop all OK within {served_s:.1f} s through the "
                          "other decode worker (the stopped one routed around after 3 s); resumed, taken back")
