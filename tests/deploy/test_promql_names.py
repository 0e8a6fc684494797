"""The PromQL reader of tests/dashboards.py: metric names and label matchers of expressions,
and the queries of a dashboard, collapsed rows included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dashboards import dashboard_queries, metric_names_in, vector_selectors

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/tandem.json"


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(tandem_time_to_first_token_seconds_bucket'
     '{model_name="$model_name"}[$__rate_interval])))', {"tandem_time_to_first_token_seconds_bucket"}),
    ("sum(rate(a_sum[5m])) / sum(rate(a_count[5m]))", {"a_sum", "a_count"}),
    ("up", {"up"}),
    ("sum without (instance, le) (foo) and on (role) group_left (instance) bar offset 5m", {"foo", "bar"}),
    ('foo{code!="rate", reason=~"by|sum(x)", q="{bar}"}', {"foo"}),
    ("max_over_time(foo[1h30m:5m]) > bool 0.5e3", {"foo"}),
    ('{__name__="baz", job="x"}', {"baz"}),
    ('{__name__=~"baz.*"}', set()),
    ("foo @ start() - foo offset -1d", {"foo"}),
    ("rate(foo[$__rate_interval]) * ${scale} + $offset - [[legacy]]", {"foo"}),
    ("job:foo:rate5m / ignoring(code) group_right sum(bar) by (le)", {"job:foo:rate5m", "bar"}),
    ('count_values("le", foo) or topk(5, baz) unless vector(1)', {"foo", "baz"}),
    ("time() - process_start_time_seconds > Inf or NaN", {"process_start_time_seconds"}),
    ("rate (foo [5m])", {"foo"}),
    ("sum(x) # a comment naming not_a_metric", {"x"}),
    ("0x1F * 1.5e-3", set()),
    ("sum by (instance) (label_replace(foo, 'dst', '$1', 'src', '(.*)'))", {"foo"}),
])
def test_metric_names_in(expr, names):
    assert metric_names_in(expr) == names


def test_vector_selectors_give_matchers():
    assert vector_selectors('foo{a="1", b!~"x\\"y"} / bar') == [
        ("foo", [("a", "=", "1"), ("b", "!~", 'x"y')]), ("bar", [])]


def test_dashboard_queries_include_collapsed_rows(tmp_path):
    board = {"panels": [
        {"type": "timeseries", "targets": [{"expr": "a"}, {"expr": ""}]},
        {"type": "row", "collapsed": True, "panels": [{"type": "stat", "targets": [{"expr": "b"}]}]},
        {"type": "row", "collapsed": False, "panels": []},
        {"type": "timeseries", "targets": [{"expr": "c", "refId": "A"}]},
    ]}
    path = tmp_path / "board.json"
    path.write_text(json.dumps(board))
    assert dashboard_queries(path) == ["a", "b", "c"]
    real = dashboard_queries(DASHBOARD)
    assert any('role="colocated"' in q for q in real)  # the Colocated row is collapsed
