"""The router serves while each pool has a healthy worker: one restarting worker does not
take it out of service, a pool with none does."""

from __future__ import annotations

from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend


def states(*healthy: bool) -> list[WorkerState]:
    return [WorkerState(f"w-{i}", handle=None, healthy=h) for i, h in enumerate(healthy)]


def test_disaggregated_needs_a_healthy_worker_in_each_pool(router_tokenizer):
    def ready(prefill, decode) -> bool:
        return RayBackend(states(*prefill), states(*decode), [], "least_loaded", router_tokenizer.spec).is_ready()

    assert ready([True], [True, True])
    assert ready([True], [False, True])  # one decode worker restarting
    assert ready([False, True], [True])
    assert not ready([False], [True, True])  # no prefill worker at all
    assert not ready([True], [False, False])


def test_colocated_needs_one_healthy_worker(router_tokenizer):
    def ready(*healthy: bool) -> bool:
        return RayBackend([], [], states(*healthy), "least_loaded", router_tokenizer.spec).is_ready()

    assert ready(False, True) and not ready(False, False)
