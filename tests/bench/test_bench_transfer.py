"""``tandem bench transfer --quick`` runs end to end (two processes, every transport, shared
memory included) and reports what it measured, with the bytes checked at the receiver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_quick_run_reports_every_transport(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "bench", "transfer", "--quick",
         "--prompt-lens", "32", "100", "--repeats", "1", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    layout = results["layout"]
    assert (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"]) == (30, 3, 64)
    assert results["weights"] == "random" and results["quick"] is True
    points = [(t["transport"], t["block_order"], t["num_tokens"]) for t in results["transfers"]]
    assert points == [(t, o, n) for t in ("ipc", "tcp", "gloo", "shm") for o in ("contiguous", "shuffled")
                      for n in (32, 100)]
    for t in results["transfers"]:
        # The checked run's rows, hashed where they landed in the receiver, are the sender's.
        assert t["received_digest"] == t["sent_digest"] and len(t["sent_digest"]) == 32
        assert t["path"] == {"gloo": "dist", "shm": "shm"}.get(t["transport"], "zmq")
        assert t["bytes"] == 2 * 30 * t["num_tokens"] * 3 * 64 * 4
        assert t["latency_s"] > 0 and t["send_calls_s"] > 0 and len(t["latencies_s"]) == 1
        assert t["bytes_per_s"] == pytest.approx(t["bytes"] / t["latency_s"])
        fastest_copy = max(t["copy_bytes_per_s"], t["copy_1t_bytes_per_s"])
        assert t["copy_ratio"] == pytest.approx(t["bytes_per_s"] / fastest_copy)
        assert t["copy_1t_ratio"] == pytest.approx(t["bytes_per_s"] / t["copy_1t_bytes_per_s"])
    [overlap] = results["overlap"]
    assert overlap["num_tokens"] == 64 and overlap["transport"] == "ipc"
    assert overlap["transfer_s"] > 0 and overlap["prefill_s"] > 0 and overlap["prefill_alone_s"] > 0
    assert overlap["tail_fraction"] == pytest.approx(overlap["tail_s"] / overlap["transfer_s"])
    # The last layer is stored before the step ends: its tail is the longer one.
    assert overlap["tail_after_last_stored_s"] >= overlap["tail_s"]
    assert "goal, ipc >= 50% of copy bandwidth" in out.stdout and "goal, tail < 10%" in out.stdout
    assert "goal, shm >= 80% of copy bandwidth" in out.stdout
    assert (tmp_path / "transfer.png").read_bytes().startswith(PNG_SIGNATURE)
