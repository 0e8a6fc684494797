"""``tandem bench swap``: a tiny end-to-end run of the real command (the model load is most of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_tiny_run_end_to_end(tmp_path: Path):
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "tandem", "bench", "swap", "--num-blocks", "1", "2", "--num-decodes", "2",
           "--decode-context", "32", "--repeats", "1", "--num-threads", "1", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "swap out+in ms" in proc.stdout and "swapping is cheaper than recomputing from" in proc.stdout
    results = json.loads((out_dir / "results.json").read_text())
    assert [r["num_blocks"] for r in results["rows"]] == [1, 2]
    assert all(r["swap_out_in_s"] > 0 and r["recompute_alone_s"] > 0 for r in results["rows"])
    assert results["num_threads"] == 1 and results["block_size"] == 16
