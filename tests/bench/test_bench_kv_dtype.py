"""`tandem bench kv-dtype`'s bookkeeping: prefixes counted to the first divergence, and the
report's figures from them (the run itself: tests/engine/test_kv_cache_dtype.py)."""

from __future__ import annotations

from tandem import cli
from tandem.bench.kv_dtype import PARITY_PROMPTS, KVDtypeRow, equal_prefix_len, report_lines


def test_equal_prefix_counts_to_the_first_divergence():
    assert equal_prefix_len([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert equal_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2  # equal again after: not counted
    assert equal_prefix_len([5], [6]) == 0
    assert equal_prefix_len([1, 2], [1, 2, 3]) == 2


def test_the_report_has_the_mean_prefix_and_the_identical_share():
    rows = [KVDtypeRow("float32", 46080, (8, 8, 8, 8), (True,) * 4, 8),
            KVDtypeRow("bfloat16", 23040, (8, 2, 8, 0), (True, False, True, False), 8)]
    assert rows[1].mean_equal_prefix == 4.5 and rows[1].identical_share == 0.5
    lines = report_lines(rows)
    assert lines[1].split() == ["float32", "46080", "8.00", "100%", "100%"]
    assert lines[2].split() == ["bfloat16", "23040", "4.50", "56%", "50%"]
    assert lines[3] == "bfloat16 vs float32, equal prefix per prompt: 8 2 8 0"


def test_eight_distinct_parity_prompts_and_the_command():
    assert len(PARITY_PROMPTS) == len(set(PARITY_PROMPTS)) == 8
    assert cli.parse_args(["bench", "kv-dtype"]).bench == "kv-dtype"
