"""The precise prefix index's own health on the router's /metrics (docs/metrics.md): how
fresh each worker's entry is, whether it waits for a snapshot, and how often batches went
missing. Read at each scrape, on the scraping thread (a copy of the index's worker table)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.router.kv_index import KVBlockIndex


class KVIndexCollector(Collector):
    def __init__(self, model_name: str, index: KVBlockIndex) -> None:
        self.model_name, self.index = model_name, index

    def collect(self) -> Iterator[Metric]:
        labels = ("model_name", "instance")
        staleness = GaugeMetricFamily(
            "tandem_router_kv_index_staleness_seconds", "Seconds since a worker's entry in the precise prefix "
            "index last moved (an event batch or a snapshot applied); it grows while the worker is quiet.",
            labels=labels)
        stale = GaugeMetricFamily("tandem_router_kv_index_stale", "1 while a worker's entry waits for a snapshot "
                                  "(a lost batch, a restart): it is scored as holding nothing.", labels=labels)
        blocks = GaugeMetricFamily("tandem_router_kv_index_blocks", "Prefix blocks the index says a worker holds, "
                                   "in any tier.", labels=labels)
        for instance, entry in self.index.entries():
            seconds = self.index.staleness_s(instance)
            staleness.add_metric((self.model_name, instance), -1.0 if seconds is None else seconds)
            stale.add_metric((self.model_name, instance), float(entry.stale))
            blocks.add_metric((self.model_name, instance), len(entry.blocks))
        yield from (staleness, stale, blocks)
        for name, documentation, value in (
                ("tandem_router_kv_index_gaps", "Event batches found missing (the worker's entry then waits for "
                                                "a snapshot).", self.index.num_gaps),
                ("tandem_router_kv_index_resyncs", "Snapshots applied to the index.", self.index.num_resyncs)):
            counter = CounterMetricFamily(name, documentation, labels=("model_name",))
            counter.add_metric((self.model_name,), value)
            yield counter
