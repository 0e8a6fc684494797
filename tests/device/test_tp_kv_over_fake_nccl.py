"""Defect 2, end to end on NCCL's rules: a tensor-parallel decode worker (two ranks in two
processes, rank 0 this one; the fake NCCL backend as their device group; the default model's
shapes on fake CUDA) receives one layer's KV over a fake NCCL pair and runs a FORWARD step
with it (tp_fake_ranks.py). The rows arrive on the device, are never pinned nor copied to the
host, and reach the device-side KV write on every rank (rank 0's broadcast on the device
group); the step's all-reduces run on the fake."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from typing import Any

from fake_cuda import SMOLLM2
from tp_fake_ranks import HANG_DUMP_S, SLOTS, run_rank

REPORT_WAIT_S = HANG_DUMP_S + 30.0


def test_tp_decode_worker_takes_kv_received_on_the_device():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rank1 = context.Process(target=run_rank, args=(1, init_method, results))  # (rank 0: here)
    rank1.start()
    try:
        mine: queue.Queue = queue.Queue()
        run_rank(0, init_method, mine)
        first = mine.get()
        # NOTE: rank 0's failure first: rank 1 then waits in a collective that never comes.
        assert "error" not in first, first["error"]
        second = second_report(rank1, results)
    finally:
        rank1.join(timeout=30)
        if rank1.is_alive():
            rank1.kill()
    assert "error" not in second, second["error"]
    reports = [first, second]
    num_rows = 2 * len(SLOTS)  # K and V of one layer
    assert first["device_backend"] == "fake_nccl"
    assert first["rows_arrived_on"] == "cuda:0" and first["logits_on"] == "cuda:0"
    assert second["rows_in_message"] == num_rows
    for report, heads in zip(reports, (2, 1)):  # 3 KV heads over 2 ranks
        assert report["pins"] == [], f"rank {report['rank']} pinned {report['pins']}"
        assert report["to_host"] == [], f"rank {report['rank']} copied device tensors to the host"
        # the step's first KV write is the arrived rows, this rank's heads, from the device
        # (the forward's own stores follow: 16 padded decode tokens a layer)
        assert report["kv_writes"][0] == ("cuda:0", (num_rows, heads, SMOLLM2.head_dim)), report["kv_writes"][:2]
        assert {device for device, _ in report["kv_writes"]} == {"cuda:0"}
        # the arrived rows (once), then two all-reduces per layer, on the fake device group
        assert report["posted"] == {"broadcast": 1, "allreduce": 2 * SMOLLM2.num_layers}, report["posted"]


def second_report(second: multiprocessing.process.BaseProcess, results: Any) -> dict[str, Any]:
    """Rank 1's report, waited for as long as its process lives (a loaded 2-core machine runs
    it minutes behind rank 0); a process that ended without one says how it ended."""
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not second.is_alive():
                break
    raise AssertionError(f"rank 1 gave no report (alive: {second.is_alive()}, exit code: {second.exitcode}); "
                         "its stack, if it hung, is in the captured stderr")
