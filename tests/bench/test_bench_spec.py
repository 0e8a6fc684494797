"""``tandem bench spec``: a tiny end-to-end run of the real command (the model load is most of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_quick_run_end_to_end(tmp_path: Path):
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "tandem", "bench", "spec", "--quick", "--num-threads", "1", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s with / without speculation: edit k=4" in proc.stdout
    results = json.loads((out_dir / "results.json").read_text())
    rows = {(r["workload"], r["k"]): r for r in results["rows"]}
    assert set(rows) == {("edit", 0), ("edit", 4), ("open", 0), ("open", 4)}
    assert results["outputs_identical"] and all(r["same_outputs"] for r in rows.values())
    assert all(r["output_tokens"] > 0 and r["tok_s"] > 0 for r in rows.values())
    assert rows["edit", 0]["draft_tokens"] == 0 and rows["edit", 0]["acceptance_rate"] is None
    # The edit prompt's output copies its passage: prompt lookup's drafts are accepted.
    assert rows["edit", 4]["accepted_tokens"] > 0 and rows["edit", 4]["acceptance_rate"] > 0
    assert (out_dir / "spec.png").read_bytes()[:8] == PNG_SIGNATURE
