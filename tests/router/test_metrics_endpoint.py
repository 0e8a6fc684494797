"""/metrics: a token when one is set, and at most MAX_SCRAPES scrapes at once (a scrape asks
every worker; more are refused at once rather than piling up)."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from tandem.router.metrics_endpoint import start_metrics_endpoint


class SlowCollector:
    """A scrape that takes as long as asking busy workers does."""

    def collect(self):
        time.sleep(1.0)
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
def slow_registry():
    registry = CollectorRegistry()
    registry.register(SlowCollector())
    return registry


def test_a_token_guards_the_scrapes(slow_registry):
    endpoint = start_metrics_endpoint(slow_registry, port=0, token="m3trics")
    try:
        assert [scrape(endpoint.port), scrape(endpoint.port, "wrong"), scrape(endpoint.port, "m3trics")] == [
            401, 401, 200]
    finally:
        endpoint.stop()


def test_at_most_max_scrapes_at_once(slow_registry):
    endpoint = start_metrics_endpoint(slow_registry, port=0, max_scrapes=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            codes = list(pool.map(lambda _: scrape(endpoint.port), range(8)))
            took = time.monotonic() - start
        assert sorted(codes) == [200, 200] + [503] * 6 and took < 3
        assert scrape(endpoint.port) == 200  # the slots are free again
    finally:
        endpoint.stop()
