"""/metrics: a token when one is set, and at most MAX_SCRAPES scrapes at once (a scrape asks
every worker; more are refused at once rather than piling up)."""

from __future__ import annotations

import concurrent.futures
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from tandem.router.metrics_endpoint import start_metrics_endpoint


class GatedCollector:
    """A scrape that takes as long as asking busy workers does: until ``opened`` is set."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def collect(self):
        self.opened.wait(30)
        yield GaugeMetricFamily("tandem_test_value", "A value.", 1.0)


def scrape(port: int, token: str | None = None) -> int:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                    timeout=30) as response:
            assert b"tandem_test_value 1.0" in response.read()
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def gated() -> tuple[CollectorRegistry, GatedCollector]:
    registry, collector = CollectorRegistry(), GatedCollector()
    registry.register(collector)
    return registry, collector


def test_a_token_guards_the_scrapes(gated):
    registry, collector = gated
    collector.opened.set()
    endpoint = start_metrics_endpoint(registry, port=0, token="m3trics")
    try:
        assert [scrape(endpoint.port), scrape(endpoint.port, "wrong"), scrape(endpoint.port, "m3trics")] == [
            401, 401, 200]
    finally:
        endpoint.stop()


def test_at_most_max_scrapes_at_once(gated):
    registry, collector = gated
    endpoint = start_metrics_endpoint(registry, port=0, max_scrapes=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            scrapes = [pool.submit(scrape, endpoint.port) for _ in range(8)]
            # Two hold their slots until the gate opens; the other six are refused at once
            # (without the limit none would return before it opens: as_completed times out).
            done = concurrent.futures.as_completed(scrapes, timeout=10)
            assert [next(done).result() for _ in range(6)] == [503] * 6
            assert sum(not f.done() for f in scrapes) == 2
            collector.opened.set()
            assert [f.result() for f in scrapes].count(200) == 2
        assert scrape(endpoint.port) == 200  # the slots are free again
    finally:
        endpoint.stop()
