"""What docs/metrics.md declares: its metric tables, and the series a scrape can return.

Used by test_dashboard.py to check that the dashboard reads only documented metrics.
"""

from __future__ import annotations

from pathlib import Path

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs/metrics.md"


def metric_tables() -> list[tuple[str, str, str]]:
    """(section, name, type) from every `| name | type | what |` table of docs/metrics.md."""
    found = []
    section, columns = "", None
    for line in METRICS_DOC.read_text().splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if not line.startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = [c.lower() for c in cells]
        elif not set("".join(cells)) <= set("-: ") and {"name", "type"} <= set(columns):
            row = dict(zip(columns, cells))
            found.append((section, row["name"].strip("`"), row["type"].lower()))
    return found


def documented_metrics() -> dict[str, str]:
    return {name: kind for _, name, kind in metric_tables()}


def exposed_series() -> dict[str, str]:
    """The series names a scrape can return, each with its kind (counter or gauge):
    a histogram X exposes X_bucket, X_sum and X_count, which are counters."""
    series = {}
    for name, kind in documented_metrics().items():
        if kind == "histogram":
            series.update({f"{name}_{suffix}": "counter" for suffix in ("bucket", "sum", "count")})
        else:
            series[name] = kind
    return series
