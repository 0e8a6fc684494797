"""Workers' metrics, gathered by the router at each scrape (docs/metrics.md says why).

Each worker renders its own registry to Prometheus text; the router parses those (text,
never pickle), merges the families of all workers (each series already carries its
worker's `role` and `instance`) and adds `tandem_worker_up`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerMetricsReport:
    """One worker's answer to a scrape."""

    role: str
    instance: str
    text: str | None
    """Its metrics in Prometheus' text format; None when it did not answer in time."""
    healthy: bool


class WorkerMetricsCollector(Collector):
    def __init__(self, model_name: str, fetch: Callable[[], list[WorkerMetricsReport]]) -> None:
        """fetch: every worker's report now (blocking; called on the metrics server's thread)."""
        self.model_name = model_name
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        try:
            reports = self.fetch()
        except Exception:  # noqa: BLE001 - a scrape still gets the router's own metrics
            logger.exception("gathering the workers' metrics failed")
            reports = []
        up = GaugeMetricFamily("tandem_worker_up", "1 when the worker answered this scrape and is healthy.",
                               labels=("model_name", "role", "instance"))
        families: dict[str, Metric] = {}
        for report in reports:
            up.add_metric((self.model_name, report.role, report.instance),
                          float(report.text is not None and report.healthy))
            for family in text_string_to_metric_families(report.text or ""):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        yield up
        yield from families.values()
