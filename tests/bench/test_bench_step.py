"""`tandem bench step --quick`: one decode step's time by part, beside its memory floor, the
eager forward and the compiled one side by side."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_step_quick_times_every_part() -> None:
    run = subprocess.run([sys.executable, "-m", "tandem", "bench", "step", "--quick", "--formats", "auto"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head = re.search(r"--quantization auto \(int4\), --activation-quantization none, batch 1, context 32: "
                     r"floor ([\d.]+) ms", run.stdout)
    assert head is not None, run.stdout
    floor_ms = float(head.group(1))
    eager, compiled = run.stdout.split("\neager step ")[1].split("\ncompiled step ")
    eager_ms, compiled_ms = (float(re.match(r"([\d.]+) ms: \d+% of the floor", part).group(1))  # type: ignore[union-attr]
                             for part in (eager, compiled))
    assert 0 < floor_ms < eager_ms and 0 < floor_ms < compiled_ms
    assert re.match(r"[\d.]+ ms: \d+% of the floor, [\d.]+x the eager step", compiled)
    for text, step_ms, names in (
        (eager, eager_ms, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "attention",
                           "RoPE + KV store", "norms + residual adds", "rest of the forward")),
        (compiled, compiled_ms, ("compiled forward",)),
    ):
        parts = dict(re.findall(r"^  (.+?)\s+([\d.-]+) ms", text, flags=re.M))
        for name in (*names, "sampling", "metadata", "schedule", "update + detokenize", "Python between"):
            assert name in parts, (name, text)
        timed = sum(float(v) for k, v in parts.items() if k != "Python between")
        assert timed <= step_ms * 1.05  # the parts are inside the step (rounded to 0.01 ms each)
    assert "qkv_proj" not in dict(re.findall(r"^  (.+?)\s+([\d.-]+) ms", compiled, flags=re.M))
