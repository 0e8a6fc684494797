"""The placement checks for real: `tandem serve --device cuda` on a machine without a GPU fails
with a clear message in seconds, and Ray's placement wait is bounded."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from tandem.router.placement import CPU, GPU, Placement, PlacementError, Pool, local_resources
from tandem.router.placement_wait import wait_placeable

TANDEM = str(Path(sys.executable).parent / "tandem")

no_local_gpu = pytest.mark.skipif((local_resources(2) or {}).get(GPU, 0) > 0, reason="this host has a GPU")


@no_local_gpu
def test_serve_on_cuda_without_a_gpu_fails_in_seconds_naming_what_it_needs():
    start = time.monotonic()
    result = subprocess.run([TANDEM, "serve", "--device", "cuda", "--http-port", "-1"], capture_output=True,
                            text=True, timeout=30)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert ("tandem: error: tandem serve cannot place its workers: needs 2 GPUs (1 prefill worker + 1 decode "
            "worker, 1 GPU each); this host has 0 GPUs") in result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"


@pytest.fixture(scope="module")
def ray_cpus() -> Iterator[tuple[float, float]]:
    """(CPUs in all, CPUs free now) of a Ray: a 2-CPU one of its own, or the session's, whose
    clusters may hold some of its CPUs."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    free = ray.available_resources().get(CPU, 0.0)
    assert free > 0, "no free CPU to place anything on"
    yield ray.cluster_resources()[CPU], free
    if started:
        ray.shutdown()


def test_placement_that_never_comes_is_refused_after_the_timeout(ray_cpus):
    cpus, free = ray_cpus
    fits = Placement((Pool("prefill", 1), Pool("decode", 1)), free / 2, 0.0)
    asyncio.run(wait_placeable(fits, 10.0))
    too_big = Placement((Pool("decode", 1, tp=2),), cpus, 0.0)  # each rank all the CPUs: never both at once
    start = time.monotonic()
    with pytest.raises(PlacementError) as refused:
        asyncio.run(wait_placeable(too_big, 0.5))
    assert time.monotonic() - start < 5
    message = str(refused.value)
    assert f"Ray could not place the workers within 0.5 s: they need {2 * cpus:g} CPUs (2 ranks)" in message
    assert f"the cluster has {cpus:g} CPUs in all" in message
    asyncio.run(wait_placeable(fits, 10.0))  # the refused group was released


def test_workers_that_do_not_start_in_time_are_named_and_stopped(ray_cpus):
    from tandem.router.cluster import ClusterConfig, start_cluster

    cfg = ClusterConfig(name_prefix="late-", start_timeout_s=0.5, num_cpus_per_rank=ray_cpus[1] / 2)
    with pytest.raises(PlacementError, match=r"worker\(s\) late-decode-0, late-prefill-0 did not finish starting "
                                             r"within 0.5 s"):
        asyncio.run(start_cluster(cfg))  # loading the model takes longer than that
    deadline = time.monotonic() + 30
    while any(name.startswith("late-") for name in ray.util.list_named_actors()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name for name in ray.util.list_named_actors() if name.startswith("late-")]
