"""``tandem bench grammar``: the real command, one repeat, on the installed library."""

from __future__ import annotations

import re
import subprocess
import sys


def test_quick_run_prints_every_case():
    cmd = [sys.executable, "-m", "tandem", "bench", "grammar", "--quick", "--libraries", "xgrammar"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m.group(1): [float(v) for v in m.group(2).split()] for m in
            re.finditer(r"^xgrammar\s+\S+\s+(json_schema|json_object|regex)\s+([0-9.\s]+?)%$", proc.stdout, re.M)}
    assert set(rows) == {"json_schema", "json_object", "regex"}, proc.stdout
    # compile ms, mask p50/mean/max, first walk, accept (us), share of the budget: all measured
    assert all(len(values) == 7 and all(v > 0 for v in values[:6]) for values in rows.values()), rows
