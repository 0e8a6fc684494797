"""The one check every cluster test that ends requests shares: every worker is empty."""

from __future__ import annotations

import asyncio
import time

from tandem.worker.api import WorkerInventory


async def inventories(backend) -> list[WorkerInventory]:
    """Every worker's inventory (a worker that does not answer within 10 s fails the check)."""
    return list(await asyncio.gather(*(asyncio.wait_for(w.handle.inventory.remote(), 10) for w in backend.workers)))


def leaks(cluster) -> dict[str, list[str]]:
    """What each worker (and the router's admission queue) still holds: {} at rest."""
    found = {i.instance: i.leaks() for i in cluster.run(inventories(cluster.backend)) if not i.is_empty}
    if cluster.backend.num_admitting:
        found["router"] = [f"num_admitting={cluster.backend.num_admitting}"]
    return found


def assert_workers_empty(cluster, timeout: float = 15) -> None:
    """Wait up to `timeout` for every worker to hold nothing: no queued, running or reserved
    request, no first token or KV transfer pending, no open stream, every block free and
    every reference count zero. Fails listing what each worker still holds."""
    deadline = time.monotonic() + timeout
    while found := leaks(cluster):
        assert time.monotonic() < deadline, f"workers not empty after {timeout} s: {found}"
        time.sleep(0.1)


def num_leaked_blocks(cluster) -> int:
    """Blocks the workers still hold (in use, or referenced) once the test settled: what a
    fault table row reports, counted from the workers themselves."""
    return sum(max(i.num_blocks - i.num_free_blocks, i.num_referenced_blocks)
               for i in cluster.run(inventories(cluster.backend)))
