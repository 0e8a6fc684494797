"""A real Prometheus scrapes a real cluster's router; its HTTP API then answers a TTFT
quantile, the query the Grafana dashboard plots."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from reference import english_token_ids

from tandem.proto import generation_pb2 as pb

pytestmark = pytest.mark.slow

TTFT_P50 = ('histogram_quantile(0.5, sum by (le) '
            '(rate(tandem_time_to_first_token_seconds_bucket{model_name="SmolLM2-135M-Instruct"}[30s])))')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def prometheus(clusters, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary (Debian package prometheus) is not installed; CI installs it")
    target = f"127.0.0.1:{clusters['disaggregated'].metrics_port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: tandem\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(base: str, expr: str) -> list[dict]:
    answer = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_prometheus_answers_a_ttft_quantile(clusters, prometheus, tokenizer):
    stub = clusters["disaggregated"].stub()
    deadline = time.monotonic() + 90
    p50 = None
    i = 0
    while p50 is None:
        assert time.monotonic() < deadline, query(prometheus, "up")
        # Keep traffic flowing, so that the 30 s rate window sees the counters grow.
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=english_token_ids(tokenizer, 20, skip=i)),
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=3))
        list(stub.Generate(request, timeout=60))
        i += 1
        result = query(prometheus, TTFT_P50)
        if result and math.isfinite(float(result[0]["value"][1])):
            p50 = float(result[0]["value"][1])
        time.sleep(0.5)
    assert 0 < p50 < 60
    (up,) = query(prometheus, 'up{job="tandem"}')
    assert up["value"][1] == "1"
    # The workers' series come through the same scrape.
    roles = {r["metric"]["role"] for r in query(prometheus, "tandem_kv_cache_capacity_blocks")}
    assert {"prefill", "decode"} <= roles
