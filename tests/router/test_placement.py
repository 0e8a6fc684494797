"""Where the workers run: the GPUs each reserves (--gpus-per-worker, fractional to share one
GPU), and the up-front check that refuses, naming what is needed and what the cluster has,
a cluster the workers could never be placed on (they would wait for it forever)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.config import WorkerConfig
from tandem.router.cluster import ClusterConfig
from tandem.router.placement import (
    CPU,
    GPU,
    Placement,
    PlacementError,
    Pool,
    check_memory_share,
    gpus_per_rank,
    pool_resource,
    worker_device,
)
from tandem.router.placement_wait import wait_ready
from tandem.worker.api import Role
from tandem.worker.host import pool_resource as host_pool_resource

CPU_ONLY = {CPU: 8.0}


def one_gpu(cpus: float = 8.0, gpus: float = 1.0) -> dict[str, float]:
    return {CPU: cpus, GPU: gpus}


@pytest.mark.parametrize("device, cluster_gpus, ranks, expected", [
    ("auto", 0, 2, 0.0),     # no GPU anywhere: the CPU
    ("cpu", 4, 2, 0.0),      # asked for the CPU: no GPU reserved, even where there are some
    ("auto", 1, 2, 0.5),     # the default serve on a one-GPU host: a prefill and a decode worker share it
    ("cuda", 1, 2, 0.5),
    ("cuda:0", 2, 2, 1.0),   # a GPU per rank: each its own
    ("auto", 2, 3, 0.5),     # 3 ranks on 2 GPUs: 2 on one, 1 on the other
    ("auto", 1, 3, 0.3333),  # rounded down to Ray's unit, so that three fit in one
    ("cuda", 0, 2, 1.0),     # nothing to share: check_fits then names the missing GPUs
])
def test_the_default_share_fits_the_cluster(device, cluster_gpus, ranks, expected):
    assert gpus_per_rank(None, device, cluster_gpus, ranks) == pytest.approx(expected)


def test_default_serve_fits_one_gpu_and_refuses_none():
    cfg = ClusterConfig()  # 1 prefill + 1 decode, device auto
    placement = cfg.check_fits(one_gpu(), "the cluster")
    assert placement.gpus_per_rank == 0.5 and placement.needs() == {CPU: 2.0, GPU: 1.0}
    assert cfg.check_fits(CPU_ONLY, "the cluster").gpus_per_rank == 0.0  # auto without GPUs: the CPU
    cuda = ClusterConfig(worker=WorkerConfig(device="cuda"))
    with pytest.raises(PlacementError) as refused:
        cuda.check_fits(CPU_ONLY, "the cluster")
    assert ("needs 2 GPUs (1 prefill worker + 1 decode worker, 1 GPU each); the cluster has 0 GPUs"
            in str(refused.value))
    assert "--device cpu" in str(refused.value)


@pytest.mark.parametrize("requested, device, tp, match", [
    (0.5, "cpu", 1, "reserve GPUs they never use"),
    (0, "cuda", 1, "would see no GPU"),
    (1.5, "auto", 1, "a fraction in"),
    (2, "auto", 1, "--prefill-tp/--decode-tp"),
    (-1, "auto", 1, "a fraction in"),
    (0.5, "cuda", 2, "NCCL needs a whole GPU per rank"),
    (None, "cuda:1", 1, "use --device cuda"),
])
def test_a_share_that_cannot_work_is_refused(requested, device, tp, match):
    with pytest.raises(PlacementError, match=match):
        gpus_per_rank(requested, device, 4, 2, max_tp=tp)


def test_an_explicit_share_is_taken_as_asked():
    assert gpus_per_rank(0.25, "auto", 1, 2) == 0.25
    assert gpus_per_rank(1, "cuda", 8, 2) == 1.0
    assert gpus_per_rank(0, "auto", 8, 2) == 0.0  # GPUs in the cluster, workers on the CPU


def test_workers_that_reserve_no_gpu_are_told_to_run_on_the_cpu():
    # Ray leaves CUDA_VISIBLE_DEVICES alone at num_gpus=0: auto would take a GPU nobody reserved.
    assert worker_device("auto", 0.0) == "cpu"
    assert worker_device("auto", 0.5) == "auto"  # the GPU Ray gave it: auto finds it
    assert worker_device("cuda", 1.0) == "cuda" and worker_device("cpu", 0.0) == "cpu"


def test_tensor_parallel_ranks_take_whole_gpus():
    cfg = ClusterConfig(prefill_tp=2, worker=WorkerConfig(device="cuda"))
    assert cfg.check_fits(one_gpu(gpus=3), "the cluster").gpus_per_rank == 1.0
    with pytest.raises(PlacementError) as refused:
        cfg.check_fits(one_gpu(gpus=1), "the cluster")
    message = str(refused.value)
    assert ("needs 3 GPUs (1 prefill worker x 2 ranks + 1 decode worker, 1 GPU per rank); "
            "the cluster has 1 GPU") in message
    assert "tensor parallelism needs a whole GPU per rank" in message and "0.5" not in message


def test_missing_cpus_and_pool_resources_are_named():
    cfg = ClusterConfig(num_decode=2, pool_resources=True)
    with pytest.raises(PlacementError) as refused:
        cfg.check_fits({CPU: 2.0, "tandem_prefill": 1.0}, "the cluster")
    message = str(refused.value)
    assert "needs 3 CPUs (1 prefill worker + 2 decode workers, 1 CPU each); the cluster has 2 CPUs" in message
    assert "needs 2 tandem_decode (2 decode workers, 1 each); the cluster has 0 tandem_decode" in message
    assert "tandem_prefill" not in message.split("(start")[0]  # the one it has is not listed as missing
    assert cfg.check_fits({CPU: 3.0, "tandem_prefill": 1.0, "tandem_decode": 2.0}, "the cluster").needs() == {
        CPU: 3.0, "tandem_prefill": 1.0, "tandem_decode": 2.0}


def test_bundles_put_the_pool_resource_on_each_workers_first_rank():
    placement = Placement((Pool("prefill", 1, 2), Pool("decode", 1)), 1.0, 1.0, pool_resources=True)
    assert placement.bundles() == [{CPU: 1.0, GPU: 1.0, "tandem_prefill": 1.0}, {CPU: 1.0, GPU: 1.0},
                                   {CPU: 1.0, GPU: 1.0, "tandem_decode": 1.0}]
    assert Placement((Pool("colocated", 2),), 1.0, 0.0).bundles() == [{CPU: 1.0}, {CPU: 1.0}]  # no GPU key on the CPU
    for role in Role:
        assert pool_resource(role.value) == host_pool_resource(role)


def test_colocated_workers_are_one_pool():
    placement = ClusterConfig(colocated=2, decode_tp=1).check_fits(one_gpu(), "the cluster")
    assert [p.role for p in placement.pools] == ["colocated"] and placement.gpus_per_rank == 0.5


def test_workers_sharing_a_gpu_may_not_each_ask_for_more_than_their_share_of_its_memory():
    with pytest.raises(PlacementError, match="at most 0.5"):
        check_memory_share(WorkerConfig.build(gpu_memory_utilization=0.9), 0.5)
    check_memory_share(WorkerConfig.build(gpu_memory_utilization=0.45), 0.5)
    check_memory_share(WorkerConfig.build(gpu_memory_utilization=0.9), 1.0)  # a whole GPU: its own
    check_memory_share(WorkerConfig(), 0.5)  # the fixed KV pool size (kv_cache_memory_gib)
    with pytest.raises(PlacementError, match="more than each worker's share"):
        ClusterConfig(worker=WorkerConfig.build(gpu_memory_utilization=0.8)).check_fits(one_gpu(), "the cluster")


class FakeHandle:
    """An actor handle whose is_ready answers after `delay` s (or raises `error`)."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.delay, self.error = delay, error
        self.is_ready = self

    def remote(self):
        async def ready() -> bool:
            await asyncio.sleep(self.delay)
            if self.error is not None:
                raise self.error
            return True
        return ready()


def test_waiting_for_workers_to_load_is_bounded_and_names_the_late_ones():
    asyncio.run(wait_ready({"prefill-0": FakeHandle(), "decode-0": FakeHandle(0.01)}, 5.0))
    with pytest.raises(PlacementError, match=r"worker\(s\) decode-0 did not finish starting within 0.2 s"):
        asyncio.run(wait_ready({"prefill-0": FakeHandle(), "decode-0": FakeHandle(60.0)}, 0.2))
    with pytest.raises(RuntimeError, match="no such model"):  # a worker that failed: its own error, at once
        asyncio.run(wait_ready({"prefill-0": FakeHandle(error=RuntimeError("no such model")),
                                "decode-0": FakeHandle(60.0)}, 30.0))
