"""Every metric the Grafana dashboard queries is one that live routers export."""

from __future__ import annotations

from pathlib import Path

import pytest
from dashboards import dashboard_queries, metric_names_in
from metrics_text import parse_samples

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "dashboards" / "tandem.json"


def test_dashboard_reads_only_exported_metrics(clusters):
    # Both kinds of cluster: the colocated row reads series only colocated workers have.
    exported = {name for cluster in clusters.values() for name, _ in parse_samples(cluster.scrape())}
    queried = {name for expr in dashboard_queries(DASHBOARD) for name in metric_names_in(expr)}
    assert len(queried) > 30
    assert queried <= exported, sorted(queried - exported)
