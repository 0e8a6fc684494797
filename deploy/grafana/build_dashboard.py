#!/usr/bin/env python3
"""Writes dashboards/tandem.json, the Grafana dashboard of a tandem cluster.

    python deploy/grafana/build_dashboard.py           # rewrite the JSON next to this script
    python deploy/grafana/build_dashboard.py --check   # exit 1 when the JSON is not what this writes

Edit this script, not the JSON: tests/deploy/test_dashboard.py checks that the checked-in JSON
is this script's output, and that every query reads only metrics that docs/metrics.md
declares. Standard library only.

Layout: five rows. Overview and Latency read the router's own series; Prefill, Decode and
Colocated read the workers' series (labels role and instance), one row per role. The
Colocated row is collapsed: it only has data when the cluster runs with --colocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "tandem.json"

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# The default of the DS_PROMETHEUS variable: the uid and name of the data source that
# provisioning/datasources/prometheus.yaml creates (kube-prometheus-stack's is also "prometheus").
DEFAULT_DATASOURCE_UID = "prometheus"
DEFAULT_DATASOURCE_NAME = "Prometheus"
RATE_WINDOW = "$__rate_interval"

MODEL = 'model_name="$model_name"'
ROUTER = (MODEL,)


def worker(role: str) -> tuple[str, ...]:
    """Label matchers of one pool's series: the selected model, role and instances."""
    return (MODEL, f'role="{role}"', 'instance=~"$instance"')


# ---- PromQL ----------------------------------------------------------------------------

def selector(metric: str, scope: tuple[str, ...], *extra: str) -> str:
    return f"{metric}{{{', '.join((*scope, *extra))}}}"


def rate(metric: str, scope: tuple[str, ...], *extra: str) -> str:
    return f"rate({selector(metric, scope, *extra)}[{RATE_WINDOW}])"


def sum_rate(metric: str, scope: tuple[str, ...], *extra: str, by: str = "") -> str:
    inner = rate(metric, scope, *extra)
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, histogram: str, scope: tuple[str, ...], by: str = "") -> str:
    labels = ", ".join(["le", by]) if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(histogram + '_bucket', scope)}))"


def mean(histogram: str, scope: tuple[str, ...]) -> str:
    return f"{sum_rate(histogram + '_sum', scope)} / {sum_rate(histogram + '_count', scope)}"


# ---- panels ----------------------------------------------------------------------------

def target(expr: str, legend: str) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}


def timeseries(title: str, description: str, targets: list[dict], unit: str = "short") -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "min": 0,
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                           "showPoints": "never", "spanNulls": False},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def worker_up_stat(description: str) -> dict:
    return {
        "type": "stat",
        "title": "Workers up",
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {
            "defaults": {
                "unit": "none",
                "mappings": [{"type": "value", "options": {
                    "0": {"text": "down", "color": "red", "index": 0},
                    "1": {"text": "up", "color": "green", "index": 1}}}],
                "thresholds": {"mode": "absolute", "steps": [
                    {"color": "red", "value": None}, {"color": "green", "value": 1}]},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
            "justifyMode": "auto", "orientation": "auto",
        },
        "targets": [target(selector("tandem_worker_up", ROUTER), "{{role}} {{instance}}")],
    }


def latency(title: str, description: str, histogram: str, scope: tuple[str, ...]) -> dict:
    """p50, p90, p99 and the mean of a histogram of seconds, over every selected series."""
    targets = [target(quantile(q, histogram, scope), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]
    return timeseries(title, description, targets + [target(mean(histogram, scope), "mean")], unit="s")


def latency_by_instance(title: str, description: str, histogram: str, scope: tuple[str, ...]) -> dict:
    """p50 and p99 of a histogram of seconds, one line per worker."""
    targets = [target(quantile(q, histogram, scope, by="instance"), f"p{round(q * 100)} {{{{instance}}}}")
               for q in (0.5, 0.99)]
    return timeseries(title, description, targets, unit="s")


def per_instance(title: str, description: str, metric: str, scope: tuple[str, ...], unit: str = "short") -> dict:
    """A gauge, one line per worker."""
    return timeseries(title, description, [target(selector(metric, scope), "{{instance}}")], unit=unit)


def requests_per_instance(scope: tuple[str, ...], description: str, transferring: bool = True) -> dict:
    gauges = ["running", "waiting"] + (["transferring"] if transferring else [])
    targets = [target(selector(f"tandem_num_requests_{g}", scope), f"{g} {{{{instance}}}}") for g in gauges]
    return timeseries("Requests per worker", description, targets)


def prefix_cache_hit_rate(scope: tuple[str, ...]) -> dict:
    expr = (f"{sum_rate('tandem_prefix_cache_hits_total', scope, by='instance')} / "
            f"{sum_rate('tandem_prefix_cache_queries_total', scope, by='instance')}")
    return timeseries("Prefix cache hit rate",
                      "Prompt tokens found in the prefix cache / prompt tokens looked up, over the rate window.",
                      [target(expr, "{{instance}}")], unit="percentunit")


def batch(scope: tuple[str, ...]) -> dict:
    return timeseries("Batch size", "Sequences and tokens in each worker's last engine step.", [
        target(selector("tandem_batch_size", scope), "sequences {{instance}}"),
        target(selector("tandem_batch_tokens", scope), "tokens {{instance}}"),
    ])


def kv_cache_usage(scope: tuple[str, ...]) -> dict:
    return per_instance("KV cache usage", "Used KV blocks / all blocks of each worker's pool.",
                        "tandem_kv_cache_usage_perc", scope, unit="percentunit")


def preemptions(scope: tuple[str, ...]) -> dict:
    return timeseries("Preemptions", "Sequences preempted per second (out of KV blocks).",
                      [target(sum_rate("tandem_num_preemptions_total", scope, by="instance"), "{{instance}}")],
                      unit="ops")


def kv_transfer_failures(scope: tuple[str, ...]) -> dict:
    return timeseries("KV transfer failures", "Transfers that did not complete, per second, by reason.",
                      [target(sum_rate("tandem_kv_transfer_failures_total", scope, by="reason"), "{{reason}}")],
                      unit="ops")


def kv_transfer_bytes(scope: tuple[str, ...], direction: str) -> dict:
    return timeseries(f"KV bytes {direction}", f"KV payload bytes {direction} per second by each worker.",
                      [target(sum_rate("tandem_kv_transfer_bytes_total", scope, f'direction="{direction}"',
                                       by="instance"), "{{instance}}")], unit="Bps")


# ---- rows ------------------------------------------------------------------------------

def overview() -> list[dict]:
    s = ROUTER
    return [
        timeseries("Request rate", "Generate calls per second (any outcome), and finished requests.", [
            target(sum_rate("tandem_request_status_total", s), "Generate calls"),
            target(sum_rate("tandem_request_success_total", s), "finished"),
        ], unit="reqps"),
        timeseries("Token throughput", "Prompt tokens of finished requests and tokens streamed to clients, per second.", [
            target(sum_rate("tandem_prompt_tokens_total", s), "prompt"),
            target(sum_rate("tandem_generation_tokens_total", s), "generation"),
        ], unit="suffix: tok/s"),
        timeseries("Requests at the router", "Generate calls in progress, and requests in the admission queue.", [
            target(f"sum({selector('tandem_router_num_requests_running', s)})", "running"),
            target(f"sum({selector('tandem_router_num_requests_waiting', s)})", "waiting"),
        ]),
        timeseries("Errors by code", "Generate calls per second that ended with a gRPC status other than OK.", [
            target(sum_rate("tandem_request_status_total", s, 'code!="OK"', by="code"), "{{code}}"),
        ], unit="reqps"),
        timeseries("Finished by reason", "Finished requests per second by finish reason.", [
            target(sum_rate("tandem_request_success_total", s, by="finished_reason"), "{{finished_reason}}"),
        ], unit="reqps"),
        timeseries("Rejected by reason", "Requests refused before any worker ran them, per second.", [
            target(sum_rate("tandem_request_rejected_total", s, by="reason"), "{{reason}}"),
        ], unit="reqps"),
        worker_up_stat("1 when the worker answered the router's last scrape and is healthy."),
        timeseries("Request length", "Prompt and output tokens of finished requests.", [
            target(quantile(q, f"tandem_request_{kind}_tokens", s), f"{kind} p{round(q * 100)}")
            for kind in ("prompt", "generation") for q in (0.5, 0.99)
        ]),
    ]


def latency_row() -> list[dict]:
    s = ROUTER
    return [
        latency("Time to first token", "Request arrival at the router to its first token sent to the client.",
                "tandem_time_to_first_token_seconds", s),
        latency("Time per output token", "Per request: (e2e - TTFT) / (output tokens - 1).",
                "tandem_request_time_per_output_token_seconds", s),
        latency("Inter-token latency", "Gap between consecutive streamed responses of a request.",
                "tandem_inter_token_latency_seconds", s),
        latency("End-to-end latency", "Arrival to the last response, finished requests.",
                "tandem_e2e_request_latency_seconds", s),
        latency("Router queue time", "Time in the router's admission queue, waiting for a decode worker with room.",
                "tandem_router_queue_time_seconds", s),
    ]


def prefill_row() -> list[dict]:
    s = worker("prefill")
    return [
        requests_per_instance(s, "Running: in the prefill batch; waiting: in the scheduler; "
                                 "transferring: KV being sent."),
        latency_by_instance("Queue time", "Arrival at the worker to first scheduled.",
                            "tandem_request_queue_time_seconds", s),
        latency("Prefill time", "First scheduled to first token.", "tandem_request_prefill_time_seconds", s),
        batch(s),
        kv_cache_usage(s),
        prefix_cache_hit_rate(s),
        kv_transfer_bytes(s, "sent"),
        latency("KV transfer time", "First layer sent to the decode worker's acknowledgement.",
                "tandem_kv_transfer_time_seconds", s),
        kv_transfer_failures(s),
    ]


def decode_row() -> list[dict]:
    s = worker("decode")
    return [
        requests_per_instance(s, "Running: in the decode batch; waiting: for KV and the first token; "
                                 "transferring: KV expected."),
        kv_cache_usage(s),
        batch(s),
        latency("Decode time", "First token to finish.", "tandem_request_decode_time_seconds", s),
        preemptions(s),
        kv_transfer_bytes(s, "received"),
        kv_transfer_failures(s),
        latency_by_instance("Queue time", "Reservation to the start of decoding (waiting for prefill and KV).",
                            "tandem_request_queue_time_seconds", s),
        latency("KV transfer time", "Reservation to the last layer in place.", "tandem_kv_transfer_time_seconds", s),
    ]


def colocated_row() -> list[dict]:
    s = worker("colocated")
    return [
        requests_per_instance(s, "Running: in the batch; waiting: in the scheduler.", transferring=False),
        kv_cache_usage(s),
        batch(s),
        latency_by_instance("Queue time", "Arrival at the worker to first scheduled.",
                            "tandem_request_queue_time_seconds", s),
        latency("Prefill time", "First scheduled to first token.", "tandem_request_prefill_time_seconds", s),
        latency("Decode time", "First token to finish.", "tandem_request_decode_time_seconds", s),
        preemptions(s),
        prefix_cache_hit_rate(s),
    ]


ROWS = [  # title, panels, collapsed
    ("Overview", overview, False),
    ("Latency", latency_row, False),
    ("Prefill", prefill_row, False),
    ("Decode", decode_row, False),
    ("Colocated", colocated_row, True),
]

PANEL_WIDTH, PANEL_HEIGHT, GRID_WIDTH = 8, 8, 24


def layout() -> list[dict]:
    """Rows and their panels with ids and grid positions, three panels to a line.

    An expanded row is followed by its panels; a collapsed row holds them in its own list.
    """
    panels: list[dict] = []
    next_id, y = 1, 0
    for title, build, collapsed in ROWS:
        row = {"type": "row", "title": title, "id": next_id, "collapsed": collapsed,
               "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []}
        next_id, y = next_id + 1, y + 1
        children = build()
        per_line = GRID_WIDTH // PANEL_WIDTH
        for i, panel in enumerate(children):
            panel["id"] = next_id
            next_id += 1
            panel["gridPos"] = {"h": PANEL_HEIGHT, "w": PANEL_WIDTH,
                                "x": (i % per_line) * PANEL_WIDTH, "y": y + (i // per_line) * PANEL_HEIGHT}
            for ref_id, t in zip("ABCDEFGH", panel["targets"]):
                t["refId"] = ref_id
        y += -(-len(children) // per_line) * PANEL_HEIGHT
        panels.append(row)
        if collapsed:
            row["panels"] = children
        else:
            panels.extend(children)
    return panels


def templating() -> dict:
    def query_variable(name: str, label: str, query: str, **extra) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
                "definition": query, "query": {"query": query, "refId": "StandardVariableQuery"},
                "refresh": 2, "sort": 1, "regex": "", "hide": 0, "options": [], "current": {},
                "includeAll": False, "multi": False, **extra}

    return {"list": [
        {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"selected": False, "text": DEFAULT_DATASOURCE_NAME, "value": DEFAULT_DATASOURCE_UID},
         "regex": "", "hide": 0, "refresh": 1, "options": [], "includeAll": False, "multi": False},
        query_variable("model_name", "Model",
                       "label_values(tandem_time_to_first_token_seconds_count, model_name)"),
        query_variable("instance", "Worker", 'label_values(tandem_worker_up{model_name="$model_name"}, instance)',
                       includeAll=True, multi=True, allValue=".*"),
    ]}


def dashboard() -> dict:
    return {
        "id": None,
        "uid": "tandem-overview",
        "title": "tandem",
        "description": "Disaggregated prefill/decode LLM serving: the router, the prefill and decode pools "
                       "(generated by deploy/grafana/build_dashboard.py; metric names in docs/metrics.md).",
        "tags": ["tandem", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": []},
        "templating": templating(),
        "panels": layout(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is not what {Path(__file__).name} writes: run it", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
