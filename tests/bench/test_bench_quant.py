"""``tandem bench quant --quick``: a tiny end-to-end run of the real command (the model load is most of it)."""

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
    cmd = [sys.executable, "-m", "tandem", "bench", "quant", "--quick", "--num-threads", "1", "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== tandem bench quant:" in proc.stdout and "decode tok/s" in proc.stdout and "util" in proc.stdout
    results = json.loads((out_dir / "results.json").read_text())
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == ["float32", "bfloat16", "int8", "int8+bf16", "int4", "int4+bf16"]
    assert all(r["decode_tok_s"] > 0 and r["perplexity"] > 1 for r in rows.values())
    f32, bf16, int8, int4 = rows["float32"], rows["bfloat16"], rows["int8"], rows["int4"]
    assert f32["tok_s_ratio"] == 1 and f32["same_tokens"] == 1
    assert f32["forced_agreement"] >= 0.9  # its own tokens, given in chunks rather than one at a time
    # Bytes are exact, whatever the machine: bf16 halves them, int8 (+ scales) quarters them.
    assert bf16["read_bytes"] * 2 == f32["read_bytes"]
    assert 0.25 < int8["bytes_ratio"] < 0.2525
    assert rows["int8+bf16"]["read_bytes"] < int8["read_bytes"]  # the same int8, norms in bf16
    assert int8["held_bytes"] > int8["read_bytes"]  # the tied embedding table stays in float for the lookup
    assert int8["forced_agreement"] >= 0.5 and abs(int8["perplexity_rel_diff"]) < 0.1
    # int4: 4 bits + a float16 scale and offset per 32 values, 5/32 of float32, but an int8 LM
    # head (exact bytes: tests/model/test_int4.py).
    assert 5 / 32 < int4["bytes_ratio"] < int8["bytes_ratio"]
    assert rows["int4+bf16"]["read_bytes"] < int4["read_bytes"]
    assert int4["held_bytes"] > int4["read_bytes"] + int4["read_bytes"] // 2  # + the CPU kernel's copy
    assert int4["forced_agreement"] >= 0.5 and abs(int4["perplexity_rel_diff"]) < 0.2
    # The memory floor, from the bandwidth measured in the same run: bytes per step / bandwidth.
    bandwidth = results["bandwidth"]["bytes_per_s"]
    assert bandwidth > 0
    for r in rows.values():
        assert r["step_read_bytes"] > r["read_bytes"]  # weights and the KV context
        assert r["floor_s"] == pytest.approx(r["step_read_bytes"] / bandwidth)
        assert r["floor_utilisation"] == pytest.approx(r["floor_s"] / r["step_s"])
        assert r["step_s"] == pytest.approx(results["num_seqs"] / r["decode_tok_s"])
        assert 0 < r["floor_utilisation"] < 5  # a ratio of two timings on a shared machine; above 1 would be odd
    assert (out_dir / "quant.png").read_bytes()[:8] == PNG_SIGNATURE
