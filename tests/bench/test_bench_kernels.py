"""``tandem bench kernels`` runs end to end on the CPU and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_tiny_run_reports_every_kernel(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem.bench.kernels", "--device", "cpu", "--batch-sizes", "1", "2",
         "--context-lens", "16", "40", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["backend"] == "torch" and results["dtype"] == "float32"
    assert [(r["batch"], r["context_len"]) for r in results["decode"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for row in results["decode"] + results["prefill"]:
        assert row["tandem_s"] > 0 and row["sdpa_s"] > 0
        assert abs(row["speedup_vs_sdpa"] - row["sdpa_s"] / row["tandem_s"]) < 1e-9
    assert all(0 < r["tandem_bw_fraction"] for r in results["decode"] + results["store_kv"])
    assert "decode attention" in out.stdout and "speedup" in out.stdout
    assert (tmp_path / "decode_bandwidth.png").read_bytes().startswith(PNG_SIGNATURE)
