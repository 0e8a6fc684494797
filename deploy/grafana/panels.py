"""PromQL and panel helpers of the tandem Grafana dashboard (build_dashboard.py lays them out).

Every query filters the selected model (`$model_name`); worker series also filter their pool's
role and the selected instances (`$instance`). Rates use Grafana's `$__rate_interval`.
Standard library only: build_dashboard.py must run under `python -S -I`.
"""

from __future__ import annotations

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
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
