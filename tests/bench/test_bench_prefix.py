"""``tandem bench prefix --quick`` end to end: one cluster, both policies, the report."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quick_run_end_to_end():
    """Three model loads and 2 conversations of 2 turns per policy: about a minute."""
    cmd = [sys.executable, "-m", "tandem", "bench", "prefix", "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m[1]: [float(x) for x in m.groups()[1:]]
            for m in re.finditer(r"^(least_loaded|prefix_aware)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", proc.stdout, re.M)}
    assert rows.keys() == {"least_loaded", "prefix_aware"}, proc.stdout
    assert all(p50 <= p99 and sent > 0 for p50, p99, sent in rows.values())
    assert re.search(r"prefix_aware / least_loaded: ttft_p50_ms [\d.]+, ttft_p99_ms [\d.]+, kv_bytes_sent [\d.]+",
                     proc.stdout), proc.stdout
