"""`tandem bench step --quick`: one decode step's time by part, beside its memory floor."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_step_quick_times_every_part() -> None:
    run = subprocess.run([sys.executable, "-m", "tandem", "bench", "step", "--quick", "--formats", "auto"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head = re.search(r"--quantization auto \(int4\), batch 1, context 32: step ([\d.]+) ms, floor ([\d.]+) ms .*: "
                     r"(\d+)% of it", run.stdout)
    assert head is not None, run.stdout
    step_ms, floor_ms = float(head.group(1)), float(head.group(2))
    assert 0 < floor_ms < step_ms
    parts = dict(re.findall(r"^  (.+?)\s+([\d.-]+) ms", run.stdout, flags=re.M))
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "attention", "RoPE + KV store",
                 "norms + residual adds", "sampling", "metadata", "schedule", "update + detokenize",
                 "rest of the forward", "Python between"):
        assert name in parts, name
    timed = sum(float(v) for k, v in parts.items() if k != "Python between")
    assert timed <= step_ms * 1.05  # the parts are inside the step (rounded to 0.01 ms each)
