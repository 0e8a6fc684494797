"""The autoscaler's loop over the router's view of its pools (router/autoscaler.py): what it
measures from the workers' loads, one change at a time, the cooldown counted from a change's
end, and finished requests reaching its SLO window. The decisions themselves are
test_autoscale.py's; a real cluster scaled by it is tests/cluster/test_pool_changes_cluster.py's."""

from __future__ import annotations

import asyncio

import pytest

from tandem.router.autoscale import AutoscaleConfig, PoolBounds, SloWindow
from tandem.router.autoscaler import Autoscaler
from tandem.router.metrics import RequestTimer, RouterMetrics
from tandem.router.policy import WorkerState
from tandem.worker.api import Role, WorkerLoad


def worker(role: Role, name: str, *, free: int = 100, waiting: int = 0, running: int = 0) -> WorkerState:
    w = WorkerState(name, handle=None)
    w.load = WorkerLoad(role, name, num_blocks=100, num_free_blocks=free, num_running=running, num_waiting=waiting,
                        num_queued_tokens=0)
    return w


class HeldPools:
    """PoolChanges' interface over WorkerStates; each scale waits until the test releases it."""

    def __init__(self, prefill: list[WorkerState], decode: list[WorkerState]) -> None:
        self.pools = {Role.PREFILL: prefill, Role.DECODE: decode}
        self.scaled: list[dict[Role, int]] = []
        self.release = asyncio.Event()

    def roles(self) -> list[Role]:
        return [Role.PREFILL, Role.DECODE]

    def pool(self, role: Role) -> list[WorkerState]:
        return self.pools[role]

    async def scale(self, sizes: dict[Role, int], drain_timeout_s: float) -> list[str]:
        self.scaled.append(sizes)
        await self.release.wait()
        self.release.clear()
        [(role, size)] = sizes.items()
        pool = self.pools[role]
        if size > len(pool):
            pool.append(worker(role, f"{role.value}-{len(pool)}"))
            return [f"added {pool[-1].instance}"]
        return [f"drained {pool.pop().instance}"]


def test_each_pool_is_measured_from_its_workers_loads():
    down = worker(Role.DECODE, "decode-2", free=0, waiting=9)
    down.healthy = False  # restarting: still the pool's, its old load not counted
    draining = worker(Role.DECODE, "decode-3", free=0, waiting=9)
    draining.draining = True  # on its way out: not the pool's
    decode = [worker(Role.DECODE, "decode-0", free=40, waiting=1, running=5),
              worker(Role.DECODE, "decode-1", free=60, running=3), down, draining]
    pools = HeldPools([worker(Role.PREFILL, "prefill-0", free=0, running=1)], decode)
    slo = SloWindow(ttft_slo_s=1.0, tpot_slo_s=0.1)
    for at, ttft, tpot in ((10.0, 0.5, 0.05), (11.0, 2.0, 0.05), (12.0, 0.5, 0.5), (13.0, 0.5, 0.05)):
        slo.record(at, ttft, tpot)
    scaler = Autoscaler(pools, AutoscaleConfig({Role.DECODE: PoolBounds(1, 4)}), slo)  # type: ignore[arg-type]
    signal = scaler.signal(Role.DECODE, 20.0)
    assert (signal.num_workers, signal.num_waiting, signal.num_running) == (3, 1, 8)
    assert signal.kv_usage == pytest.approx(0.5) and signal.slo_attainment == pytest.approx(0.75)
    prefill = scaler.signal(Role.PREFILL, 20.0)
    assert (prefill.num_workers, prefill.num_running, prefill.kv_usage) == (1, 1, 1.0)
    assert prefill.slo_attainment == pytest.approx(0.75)


def test_one_change_at_a_time_and_the_cooldown_counts_from_its_end():
    async def body() -> None:
        decode = [worker(Role.DECODE, "decode-0", waiting=3)]
        pools = HeldPools([worker(Role.PREFILL, "prefill-0")], decode)
        config = AutoscaleConfig({Role.DECODE: PoolBounds(1, 3)}, up_after_s=2.0, down_after_s=10.0, cooldown_s=5.0)
        clock = [0.0]
        scaler = Autoscaler(pools, config, SloWindow(1.0, 0.1), clock=lambda: clock[0])  # type: ignore[arg-type]
        scaler.tick(100.0)
        scaler.tick(101.9)
        assert pools.scaled == []  # pressure for 1.9 s of 2
        scaler.tick(102.0)
        await asyncio.sleep(0)
        assert pools.scaled == [{Role.DECODE: 2}]
        for now in (103.0, 110.0, 120.0):  # the change runs: nothing else starts, however long it takes
            scaler.tick(now)
            await asyncio.sleep(0)
        assert pools.scaled == [{Role.DECODE: 2}]
        clock[0] = 121.0  # when the change ends
        pools.release.set()
        while scaler.changes_made == []:
            await asyncio.sleep(0)
        assert scaler.changes_made == ["added decode-1"]
        ended = 121.0  # the cooldown counts from the change's end, not from its start at 102
        decode[1].load = decode[0].load  # both workers swamped
        scaler.tick(ended + 2.0)
        scaler.tick(ended + 4.9)
        await asyncio.sleep(0)
        assert pools.scaled == [{Role.DECODE: 2}]  # pressure held 2.9 s, but within the cooldown
        scaler.tick(ended + 5.0)
        await asyncio.sleep(0)
        assert pools.scaled == [{Role.DECODE: 2}, {Role.DECODE: 3}]
        pools.release.set()
        await scaler.stop()
        assert scaler.changes_made == ["added decode-1", "added decode-2"]

    asyncio.run(body())


def test_finished_requests_reach_the_slo_window():
    metrics = RouterMetrics("m", 2048)
    metrics.slo_window = SloWindow(ttft_slo_s=60.0, tpot_slo_s=60.0)
    RequestTimer(metrics).finished(0)  # no token sent: nothing to measure
    timer = RequestTimer(metrics)
    timer.tokens_sent(1)
    timer.tokens_sent(2)
    timer.finished(3)
    assert len(metrics.slo_window) == 1
    [(_, ttft, tpot)] = metrics.slo_window._entries
    assert 0 <= ttft < 1 and tpot is not None and 0 <= tpot < 1
