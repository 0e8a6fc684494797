#!/usr/bin/env python3
"""Writes dashboards/tandem.json, the Grafana dashboard of a tandem cluster.

    python deploy/grafana/build_dashboard.py           # rewrite the JSON next to this script
    python deploy/grafana/build_dashboard.py --check   # exit 1 when the JSON is not what this writes

Edit this script (the rows) or panels.py beside it (the PromQL and panel helpers), not the
JSON: tests/deploy/test_dashboard.py checks that the checked-in JSON is this script's output,
and that every query reads only metrics that docs/metrics.md declares. Standard library only.

Layout: five rows. Overview and Latency read the router's own series; Prefill, Decode and
Colocated read the workers' series (labels role and instance), one row per role. The
Colocated row is collapsed: it only has data when the cluster runs with --colocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards" / "tandem.json"

# panels.py sits beside this script. Python puts a script's directory on sys.path, but not
# under -I, nor when this file is loaded as a module (the tests do): add it here.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from panels import (  # noqa: E402
    DATASOURCE,
    ROUTER,
    batch,
    kv_cache_usage,
    kv_transfer_bytes,
    kv_transfer_failures,
    latency,
    latency_by_instance,
    preemptions,
    prefix_cache_hit_rate,
    quantile,
    requests_per_instance,
    selector,
    sum_rate,
    target,
    timeseries,
    worker,
    worker_up_stat,
)

# The default of the DS_PROMETHEUS variable: the uid and name of the data source that
# provisioning/datasources/prometheus.yaml creates (kube-prometheus-stack's is also "prometheus").
DEFAULT_DATASOURCE_UID = "prometheus"
DEFAULT_DATASOURCE_NAME = "Prometheus"


# ---- rows ------------------------------------------------------------------------------

def overview() -> list[dict]:
    s = ROUTER
    return [
        timeseries("Request rate", "Generate calls per second (any outcome), and finished requests.", [
            target(sum_rate("tandem_request_status_total", s), "Generate calls"),
            target(sum_rate("tandem_request_success_total", s), "finished"),
        ], unit="reqps"),
        timeseries("Token throughput",
                   "Prompt tokens of finished requests and tokens streamed to clients, per second.", [
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
        timeseries("Moves and pool changes",
                   "Streams moved to another worker after theirs died, hung or was drained (per completion), "
                   "buffered requests run again, and workers added to or drained out of each pool, per second.", [
            target(sum_rate("tandem_request_migration_seconds_count", s), "streams moved"),
            target(sum_rate("tandem_request_reruns_total", s), "buffered reruns"),
            target(sum_rate("tandem_pool_changes_total", s, by="pool, change"), "{{pool}} {{change}}"),
        ]),
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
