"""The Grafana dashboard and its provisioning.

The dashboard is generated (deploy/grafana/build_dashboard.py, with deploy/grafana/panels.py)
and reads only metrics that docs/metrics.md declares, each filtered by the selected model.
The Prometheus config and promtool's checks are in test_prometheus_config.py; the PromQL
reader these tests use (tests/dashboards.py) is tested in test_promql_names.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dashboards import dashboard_queries, iter_panels, metric_names_in, vector_selectors
from metrics_doc import documented_metrics, exposed_series, metric_tables

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "deploy/grafana/build_dashboard.py"
DASHBOARD = ROOT / "deploy/grafana/dashboards/tandem.json"
DATASOURCES = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml"
DASHBOARD_PROVIDERS = ROOT / "deploy/grafana/provisioning/dashboards/tandem.yaml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"

DATASOURCE_REF = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
MODEL_FILTER = ("model_name", "=", "$model_name")
WORKER_ROWS = {"Prefill": "prefill", "Decode": "decode", "Colocated": "colocated"}
LATENCY_HISTOGRAMS = [
    "tandem_time_to_first_token_seconds",
    "tandem_request_time_per_output_token_seconds",
    "tandem_inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds",
    "tandem_router_queue_time_seconds",
]
# What each row must show (the brief of the dashboard), as the metrics its queries read.
ROW_METRICS = {
    "Overview": {"tandem_request_status_total", "tandem_request_success_total", "tandem_request_rejected_total",
                 "tandem_prompt_tokens_total", "tandem_generation_tokens_total", "tandem_worker_up",
                 "tandem_router_num_requests_running", "tandem_router_num_requests_waiting"},
    "Latency": {f"{h}_{suffix}" for h in LATENCY_HISTOGRAMS for suffix in ("bucket", "sum", "count")},
    "Prefill": {"tandem_request_queue_time_seconds_bucket", "tandem_request_prefill_time_seconds_bucket",
                "tandem_batch_size", "tandem_kv_cache_usage_perc", "tandem_prefix_cache_hits_total",
                "tandem_prefix_cache_queries_total", "tandem_kv_transfer_bytes_total",
                "tandem_kv_transfer_time_seconds_bucket"},
    "Decode": {"tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc",
               "tandem_batch_size", "tandem_request_decode_time_seconds_bucket", "tandem_num_preemptions_total",
               "tandem_kv_transfer_bytes_total", "tandem_kv_transfer_failures_total",
               "tandem_request_queue_time_seconds_bucket"},
    "Colocated": {"tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc",
                  "tandem_batch_size", "tandem_request_queue_time_seconds_bucket",
                  "tandem_request_prefill_time_seconds_bucket", "tandem_request_decode_time_seconds_bucket"},
}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rows() -> dict[str, list[dict]]:
    """Row title -> its panels: those after an expanded row, or those a collapsed row holds."""
    out: dict[str, list[dict]] = {}
    current = None
    for panel in load_dashboard()["panels"]:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
            current.extend(panel.get("panels", []))
        elif current is not None:
            current.append(panel)
    return out


def row_queries(title: str) -> list[str]:
    return [t["expr"] for p in rows()[title] for t in p.get("targets", [])]


# ---- the dashboard is generated --------------------------------------------------------

def test_json_is_the_generators_output():
    spec = importlib.util.spec_from_file_location("build_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert DASHBOARD.read_text() == generator.render(), \
        "deploy/grafana/dashboards/tandem.json differs: run python deploy/grafana/build_dashboard.py"


def test_generator_needs_only_the_standard_library():
    # -S: no site-packages; -I: no user site, no PYTHON* variables.
    done = subprocess.run([sys.executable, "-S", "-I", str(GENERATOR), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---- the metrics it reads --------------------------------------------------------------

def test_metrics_doc_tables_are_read():
    metrics = documented_metrics()
    assert metrics["tandem_time_to_first_token_seconds"] == "histogram"
    assert metrics["tandem_worker_up"] == "gauge"
    assert metrics["tandem_kv_transfer_bytes_total"] == "counter"
    assert len(metrics) >= 30
    assert set(metrics.values()) <= {"counter", "gauge", "histogram"}


def test_queries_read_only_documented_metrics():
    series = exposed_series()
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 40
    unknown = {name: q for q in queries for name in metric_names_in(q) if name not in series}
    assert not unknown, f"metrics not in docs/metrics.md: {unknown}"


def test_variables_read_only_documented_metrics():
    series = exposed_series()
    for variable in load_dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["definition"])
            assert inner, variable["definition"]
            assert metric_names_in(inner.group(1)) <= set(series), variable["definition"]
            assert variable["query"]["query"] == variable["definition"]


def test_counters_are_read_through_rate_and_gauges_are_not():
    series = exposed_series()
    for query in dashboard_queries(DASHBOARD):
        for name in metric_names_in(query):
            for m in re.finditer(rf"(?<![\w:]){re.escape(name)}\s*{{", query):
                wrapped = query[:m.start()].rstrip().endswith("rate(")
                if series[name] == "counter":
                    assert wrapped, f"counter {name} outside rate(): {query}"
                else:
                    assert not wrapped, f"gauge {name} inside rate(): {query}"


def test_every_selector_filters_the_selected_model():
    for query in dashboard_queries(DASHBOARD):
        selectors = vector_selectors(query)
        assert selectors, query
        for name, matchers in selectors:
            assert MODEL_FILTER in matchers, f"{name} not filtered by model_name: {query}"


def test_rate_windows_are_grafanas_rate_interval():
    for query in dashboard_queries(DASHBOARD):
        assert re.findall(r"\[([^\]]*)\]", query) == ["$__rate_interval"] * query.count("["), query


# ---- rows and panels -------------------------------------------------------------------

def test_rows_exist_and_show_what_they_must():
    found = rows()
    assert list(found) == list(ROW_METRICS)
    for title, required in ROW_METRICS.items():
        read = set().union(*(metric_names_in(q) for q in row_queries(title)))
        assert required <= read, f"row {title} lacks {required - read}"


def test_worker_rows_filter_their_role_and_the_instance_variable():
    for title, role in WORKER_ROWS.items():
        queries = row_queries(title)
        assert queries
        for query in queries:
            for name, matchers in vector_selectors(query):
                assert ("role", "=", role) in matchers, f"{title}: {query}"
                assert ("instance", "=~", "$instance") in matchers, f"{title}: {query}"


def test_router_rows_read_router_series():
    router = {name for section, name, _ in metric_tables() if section.startswith("Router")}
    assert "tandem_worker_up" in router
    for title in ("Overview", "Latency"):
        for query in row_queries(title):
            bases = {re.sub(r"_(bucket|sum|count)$", "", n) for n in metric_names_in(query)}
            assert bases <= router, query


@pytest.mark.parametrize("histogram", LATENCY_HISTOGRAMS)
def test_latency_panels_show_quantiles_and_mean(histogram):
    queries = row_queries("Latency")
    window = "[$__rate_interval]"
    for q in ("0.5", "0.9", "0.99"):
        expected = (f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket"
                    f'{{model_name="$model_name"}}{window})))')
        assert expected in queries
    mean = (f'sum(rate({histogram}_sum{{model_name="$model_name"}}{window})) / '
            f'sum(rate({histogram}_count{{model_name="$model_name"}}{window}))')
    assert mean in queries


def test_queue_time_per_worker_in_both_pools():
    for title in ("Prefill", "Decode"):
        per_instance = [q for q in row_queries(title)
                        if "tandem_request_queue_time_seconds_bucket" in q and "by (le, instance)" in q]
        assert {q.split(",")[0] for q in per_instance} == {"histogram_quantile(0.5", "histogram_quantile(0.99"}


def test_kv_bytes_direction_matches_the_pool():
    for title, direction in (("Prefill", "sent"), ("Decode", "received")):
        matchers = [m for q in row_queries(title) for name, m in vector_selectors(q)
                    if name == "tandem_kv_transfer_bytes_total"]
        assert matchers and all(("direction", "=", direction) in m for m in matchers)


def test_dashboard_metadata_and_layout():
    board = load_dashboard()
    assert board["uid"] == "tandem-overview"
    assert 36 <= board["schemaVersion"] <= 41
    panels = list(iter_panels(board))
    assert {p["type"] for p in panels} == {"row", "timeseries", "stat"}
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if p["type"] != "row":
            assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    # Expanded rows' panels must not overlap.
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        pos = p["gridPos"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & area, p["title"]
        cells |= area


def test_variables():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert list(variables) == ["DS_PROMETHEUS", "model_name", "instance"]
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["definition"] == \
        "label_values(tandem_time_to_first_token_seconds_count, model_name)"
    instance = variables["instance"]
    assert instance["multi"] and instance["includeAll"] and instance["allValue"] == ".*"


def test_datasources_are_the_variable():
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "datasource" in node:
                refs.append(node["datasource"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(load_dashboard())
    assert refs and all(ref == DATASOURCE_REF for ref in refs), {json.dumps(r) for r in refs}


# ---- provisioning ----------------------------------------------------------------------

def test_provisioned_datasource_is_the_dashboards_default():
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    variable = next(v for v in load_dashboard()["templating"]["list"] if v["name"] == "DS_PROMETHEUS")
    assert source["type"] == "prometheus"
    assert source["uid"] == variable["current"]["value"]
    assert source["name"] == variable["current"]["text"]
    assert source["url"] == "http://prometheus:9090"
    # $__rate_interval must span several scrapes of the tandem job.
    assert source["jsonData"]["timeInterval"] == tandem_job()["scrape_interval"]


def test_dashboard_provider_reads_the_dashboards_folder():
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def tandem_job() -> dict:
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    return jobs["tandem"]
