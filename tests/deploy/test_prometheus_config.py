"""The Prometheus config, and promtool's checks of it and of the dashboard's queries.

With promtool on PATH (Debian package `prometheus`) every dashboard query must parse and
prometheus.yml must load; without it those two tests skip. The Grafana data source that
reads this Prometheus is checked in test_dashboard.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from dashboards import dashboard_queries

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/tandem.json"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"


def queries_with_variables_filled() -> list[str]:
    return [q.replace("$__rate_interval", "1m") for q in dashboard_queries(DASHBOARD)]


def test_prometheus_scrapes_the_router_and_itself():
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    assert set(jobs) == {"tandem", "prometheus"}
    tandem = jobs["tandem"]
    assert tandem["static_configs"] == [{"targets": ["router:9464"]}]
    assert tandem["scrape_interval"] == "5s"
    assert tandem.get("metrics_path", "/metrics") == "/metrics"
    # Worker series carry their own `instance`; without honor_labels Prometheus renames it.
    assert tandem["honor_labels"] is True
    assert jobs["prometheus"]["static_configs"] == [{"targets": ["localhost:9090"]}]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not on PATH (Debian package `prometheus`; CI installs it)")
    return path


def test_promtool_parses_every_query(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": q} for i, q in enumerate(queries_with_variables_filled())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules, indent=1))  # JSON is YAML
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_prometheus_config():
    done = subprocess.run([promtool(), "check", "config", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
