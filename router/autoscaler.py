"""The router's autoscaler (``tandem serve --autoscale decode=1:4``): every few seconds it measures
each pool from the loads the router polls anyway and the SLO attainment of the requests it
finished (router/autoscale.py decides), and adds or drains one worker through PoolChanges. One
change at a time; the pool's cooldown counts from the end of a change, so a worker that is
still loading is never mistaken for capacity that did not help."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tandem.router.autoscale import AutoscaleConfig, AutoscalePolicy, PoolSignal, ScaleStep, SloWindow
from tandem.router.pool_changes import DEFAULT_DRAIN_TIMEOUT_S, PoolChanges
from tandem.worker.api import Role

logger = logging.getLogger(__name__)

AUTOSCALE_EVERY_S = 2.0


class Autoscaler:
    def __init__(self, changes: PoolChanges, config: AutoscaleConfig, slo: SloWindow,
                 every_s: float = AUTOSCALE_EVERY_S, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """config: for pools ``changes`` has. slo: the window the router's finished requests are
        recorded in (RouterMetrics.slo_window), on ``clock``'s time."""
        self.changes = changes
        self.policy = AutoscalePolicy(config)
        self.slo = slo
        self.every_s = every_s
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.changes_made: list[str] = []
        """What it did, in order (e.g. "added decode-2"), for logs and tests."""
        self._change: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None

    def signal(self, role: Role, now: float) -> PoolSignal:
        """The pool's measure now. Its workers are those not draining, healthy or not: a worker
        that Ray is restarting is still the pool's (no replacement is started for it)."""
        pool = [w for w in self.changes.pool(role) if not w.draining]
        loads = [w.load for w in pool if w.healthy and w.load is not None]
        num_blocks = sum(load.num_blocks for load in loads)
        return PoolSignal(role, len(pool), num_waiting=sum(load.num_waiting for load in loads),
                          num_running=sum(load.num_running for load in loads),
                          kv_usage=1 - sum(load.num_free_blocks for load in loads) / num_blocks if num_blocks else 0.0,
                          slo_attainment=self.slo.attainment(role, now))

    def tick(self, now: float) -> None:
        """Decide for each pool; start the first change decided (none while one runs)."""
        if self._change is not None:
            return
        for role in self.changes.roles():
            signal = self.signal(role, now)
            step = self.policy.decide(signal, now)
            if step is ScaleStep.HOLD:
                continue
            size = signal.num_workers + int(step)
            logger.warning("autoscale: %s -> %d %s workers (%s)", "adding" if step is ScaleStep.UP else "removing",
                           size, role.value, self.policy.reason(role))
            self.policy.changed(role, now)
            self._change = asyncio.get_running_loop().create_task(self._scale(role, size))
            return

    async def _scale(self, role: Role, size: int) -> None:
        try:
            self.changes_made += await self.changes.scale({role: size}, self.drain_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed change is logged; the next tick decides again
            logger.error("autoscale: bringing the %s pool to %d failed: %s", role.value, size, e)
        finally:
            self.policy.changed(role, self.clock())  # the cooldown counts from the change's end
            self._change = None

    def start(self) -> None:
        async def run() -> None:
            while True:
                self.tick(self.clock())
                await asyncio.sleep(self.every_s)
        self._loop_task = asyncio.get_running_loop().create_task(run())

    async def stop(self) -> None:
        """Stop deciding, and wait for a change under way (a worker half started would leak)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._change is not None:
            await asyncio.gather(self._change, return_exceptions=True)
