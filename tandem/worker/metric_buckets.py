"""Histogram buckets of the Prometheus metrics (docs/metrics.md), shared by the router and
the workers. Torch-free.

vLLM's buckets, extended down to sub-millisecond so that GPU-speed steps resolve too,
and up to tens of minutes so that CPU-speed requests do not all land in +Inf.
"""

from __future__ import annotations

TTFT_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Time to first token."""

TOKEN_LATENCY_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""Inter-token latency and time per output token."""

REQUEST_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
                   10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""Request-level spans: end-to-end, queue, prefill, decode, KV transfer."""


def token_count_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the first bound >= max_value (vLLM's 1-2-5 series)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            buckets.append(float(m * scale))
            if m * scale >= max_value:
                return tuple(buckets)
        scale *= 10
