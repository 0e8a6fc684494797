"""``tandem bench detokenize``: the real command, briefly."""

from __future__ import annotations

import re
import subprocess
import sys


def test_quick_run_prints_both_paths_for_every_case():
    cmd = [sys.executable, "-m", "tandem", "bench", "detokenize", "--rounds", "1", "--num-tokens", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^(English and code|multilingual and emoji)\s+([02])\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)x$",
                      proc.stdout, re.M)
    assert sorted((name, stops) for name, stops, *_ in rows) == [
        ("English and code", "0"), ("English and code", "2"), ("multilingual and emoji", "0"),
        ("multilingual and emoji", "2")], proc.stdout
    assert all(float(fast) > 0 and float(window) > 0 for _, _, fast, window, _ in rows)
